"""The Gluon FP8 flash-attention backward (graphquant.kernels.gluon_attention_backward).

On the CPU: compiled for Hopper (sm_90; Gluon kernels do not run under Triton's interpreter), the
loop most of its tiles take spills nothing and ptxas serializes none of its wgmmas. On the GPU: dQ, dK, dV and dS's amax are
the Triton backward's bit for bit (which tests/test_triton_attention.py holds to the emulation's
bound) wherever the order of the atomic adds cannot change a bit, and dK, dV and dS's amax
everywhere else, dQ there held to the emulation's bound; dK and dV it stores in bfloat16 or
float16 (no groups) are its float32 ones rounded once.
"""

import re

import ptxas
import pytest
import torch

from test_gluon_attention import _sass, loops_issuing
from test_triton_attention import assert_same_bits, backward_arguments, check_gradients_in_their_dtype, check_nan_in_ds_amax


def _compiled_for_sm90(causal: bool, head_dim: int, groups: int, stages: int, whole: bool = False):
    """gluon_attention_backward's kernel compiled for Hopper (on any machine), dO and dS in E5M2,
    lengths multiples of 16 (as ``backward`` takes them; ``whole``: of its tiles, so that no key
    or row needs a mask), dK and dV stored in bfloat16 (added into in float32 under groups)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from graphquant.kernels import gluon_attention_backward

    kernel = gluon_attention_backward._backward_kernel
    constants = dict(GROUPS=groups, HEAD_DIM=head_dim, CAUSAL=causal, STAGES=stages, P_CODE=gl.float8e4nv, DS_CODE=gl.float8e5,
                     KEY_MASK=not whole, ROW_MASK=not whole)
    e4m3 = dict.fromkeys(("Q", "QT", "K", "KT", "V"), "*fp8e4nv")
    fp32 = dict.fromkeys(("LSE", "DELTA", "SCALES"), "*fp32")
    grads = dict.fromkeys(("DK", "DV"), "*bf16" if groups == 1 else "*fp32")
    pointers = {**e4m3, "DO": "*fp8e5", "DOT": "*fp8e5", **fp32, **grads, "DS_AMAX_BITS": "*i32"}
    scalars = {"softmax_scale": "fp32", "seq_q": "i32", "seq_k": "i32", "qt_stride": "i32", "kt_stride": "i32", "section": "i32"}
    dq_tiles = gluon_attention_backward.dq_tiles(torch.empty(1, 1, 64, head_dim, device="meta"))
    descriptors = {"DQ_TILES": f"tensordesc<fp32{dq_tiles.block_shape},{dq_tiles.layout!r}>"}
    signature = {name: {**pointers, **scalars, **descriptors}.get(name, "constexpr") for name in kernel.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names) if name in {*pointers, *scalars} - {"softmax_scale"}}
    return triton.compile(GluonASTSource(kernel, signature, constants, aligned), target=GPUTarget("cuda", 90, 64),
                          options={"num_warps": gluon_attention_backward.NUM_WARPS.value})


SM90_CASES = [  # head dim, groups, causal, lengths whole tiles
    (128, 1, False, False), (128, 1, False, True), (128, 1, True, False), (128, 1, True, True), (128, 4, True, False),
    (64, 1, False, False), (64, 2, True, True),
]


@pytest.mark.parametrize("head_dim, groups, causal, whole", SM90_CASES,
                         ids=[f"d{d}-g{g}-{'causal' if c else 'full'}{'-whole' if w else ''}" for d, g, c, w in SM90_CASES])
def test_backward_compiles_for_sm90_without_spills(head_dim, groups, causal, whole):
    """Compiled for Hopper at the default stages, ptxas serializes no wgmma (each product is
    waited for where the schedule says, not where ptxas must), and the query loop most tiles take
    (without a mask the one loop, under a causal mask the unmasked loop between the masked ones: the
    diagonal's tiles, a last tile whose rows do not tile) stores at most 4 words a tile to local
    memory at head dim 128 without a mask and 8 under a causal mask (the products' warps have 240
    registers), the masked loops at most 8 too, nothing at head dim 64. Each loop waits for its tile
    on an mbarrier and copies nothing itself (no LDGSTS: the copying partition's cp.async)."""
    pytest.importorskip("triton")
    from graphquant.kernels import gluon_attention_backward

    compiled = _compiled_for_sm90(causal, head_dim, groups, gluon_attention_backward.DEFAULT_CONFIG.num_stages, whole)
    report = ptxas.report(compiled.asm["ptx"])
    assert "serialized" not in report, report
    sass = _sass(compiled.asm["cubin"])
    loops = loops_issuing(sass, re.compile("QGMMA"))
    stores = [sum(bool(re.match(r"(?:@!?P\w+ )?STL\b", i)) for i in loop) for loop in loops]
    masks = [sum("FSEL" in i for i in loop) for loop in loops]
    main = 0 if not causal else 1
    assert len(loops) == (3 if causal else 1) and (not causal or masks[1] == 0 < masks[0]), masks
    assert stores[main] <= (0 if head_dim == 64 else 8 if causal else 4), stores
    assert max(stores) <= (8 if head_dim == 128 else 0), stores
    assert all(any("SYNCS.PHASECHK" in i for i in loop) and not any("LDGSTS" in i for i in loop) for loop in loops)
    assert any("LDGSTS" in i for _, i in sass)


def test_configurations_refuse_what_the_kernel_cannot_run():
    pytest.importorskip("triton")
    from graphquant.kernels.gluon_attention_backward import GluonBackwardConfig

    with pytest.raises(ValueError, match=r"GluonBackwardConfig\(num_stages=4, .*\) is not a configuration: num_stages 2 or 3"):
        GluonBackwardConfig(num_stages=4)
    with pytest.raises(ValueError, match=r"heads_a_section=0\) is not a configuration: heads_a_section of at least 1"):
        GluonBackwardConfig(heads_a_section=0)


def test_backward_refuses_lengths_it_cannot_copy():
    pytest.importorskip("triton")
    from graphquant.kernels import gluon_attention_backward

    args = backward_arguments(1, 2, 2, 64, 100, 64, False, device="cpu", forward=False)
    with pytest.raises(ValueError, match="takes query and key lengths that are multiples of 16, not 64 and 100"):
        gluon_attention_backward.backward(*args, 64**-0.5, False, "e4m3", "e5m2", torch.bfloat16)


def test_backward_of_no_query_is_zero_without_a_launch():
    """No query row: dQ has no tile for a TMA descriptor to describe, and dK and dV (stored whole,
    not added into) are zeros, not the uninitialized memory a kernel never wrote."""
    pytest.importorskip("triton")
    from graphquant.kernels import gluon_attention_backward

    args = backward_arguments(1, 2, 2, 0, 64, 64, False, device="cpu", forward=False)
    dq, dk, dv, ds_amax = gluon_attention_backward.backward(*args, 64**-0.5, False, "e4m3", "e5m2", torch.bfloat16)
    assert dq.shape == (1, 2, 0, 64) and dk.dtype == torch.bfloat16 and not dk.any() and not dv.any() and ds_amax.item() == 0


# -- on the GPU ----------------------------------------------------------------------------------

def _backwards(case, causal, grad_dtype, seed=0):
    """(Gluon's, Triton's) dQ, dK, dV and dS's amax of ``case`` (batch, heads, kv heads, Lq, Lk,
    head dim), P in E4M3 and dS in E5M2, dK and dV in ``grad_dtype``, the Triton backward in the
    configuration with the Gluon backward's bits."""
    from graphquant.kernels import gluon_attention_backward, triton_attention_backward

    args = (*backward_arguments(*case, causal, seed), case[-1] ** -0.5, causal, "e4m3", "e5m2", grad_dtype)
    return gluon_attention_backward.backward(*args), triton_attention_backward.backward(*args, gluon_attention_backward.triton_config())


# At most two key tiles add into a dQ tile and two query heads into a key/value head's dK and dV:
# a sum of two fp32 terms into zero has one value in either order.
EXACT_CASES = [  # batch, heads, kv heads, Lq, Lk (multiples of 16), head dim
    (2, 4, 2, 1008, 256, 128),  # grouped, query rows that do not tile, two key tiles
    (1, 4, 4, 304, 208, 64),  # head dim 64, neither length tiles
    (1, 2, 2, 112, 240, 128),  # fewer queries than keys: under a causal mask, keys no row sees
    (2, 2, 1, 2048, 128, 128),  # many query tiles, one key tile
]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", EXACT_CASES, ids=[f"b{b}-h{h}/{kv}-{lq}x{lk}-d{d}" for b, h, kv, lq, lk, d in EXACT_CASES])
def test_gluon_backward_is_the_triton_backward_bit_for_bit(case, causal):
    """dQ, dK, dV and dS's amax of the Gluon backward are the Triton backward's bit for bit, dK
    and dV asked in float32 and in bfloat16."""
    for grad_dtype in (torch.float32, torch.bfloat16):
        gluon, triton = _backwards(case, causal, grad_dtype)
        assert_same_bits(("dQ", "dK", "dV", "dS amax"), gluon, triton, f"{grad_dtype}: ")


@pytest.mark.gpu
def test_gluon_gradients_in_their_dtype():
    """``check_gradients_in_their_dtype`` of the Gluon backward: dK and dV it stores in bfloat16
    and float16 are its float32 ones rounded once; and ``check_nan_in_ds_amax``."""
    from graphquant.kernels import gluon_attention_backward

    print(check_gradients_in_their_dtype(gluon_attention_backward.backward, "cuda"))
    print(check_nan_in_ds_amax(gluon_attention_backward.backward, "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", [(2, 4, 2, 2048, 2048, 128), (1, 4, 4, 1024, 1008, 64)], ids=["gqa-l2048-d128", "l1024x1008-d64"])
def test_gluon_backward_is_the_triton_backward_but_for_dq(case, causal):
    """Many key tiles a dQ tile (whose atomic adds meet in no fixed order on either side): dK, dV
    and dS's amax are the Triton backward's bit for bit, dK and dV asked in float32 and in bfloat16."""
    for grad_dtype in (torch.float32, torch.bfloat16):
        gluon, triton = _backwards(case, causal, grad_dtype)
        assert_same_bits(("dK", "dV", "dS amax"), gluon[1:], triton[1:], f"{grad_dtype}: ")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads, kv_heads, seq, d", [(8, 2, 1008, 128), (4, 4, 2048, 64)], ids=["gqa-l1008-d128", "l2048-d64"])
def test_gluon_backward_against_the_emulation(heads, kv_heads, seq, d, causal):
    """``check_backward_against_the_emulation`` with the Gluon backward at batch 2: dQ of many key
    tiles (whose adds meet in no fixed order) within the emulation's bound, as the Triton backward's."""
    from graphquant.kernels import backends
    from test_triton_attention import check_backward_against_the_emulation

    print(check_backward_against_the_emulation(2, heads, kv_heads, seq, seq, d, causal, "cuda", backward=backends.GemmBackend(backends.GLUON_FLASH_ATTENTION)))
