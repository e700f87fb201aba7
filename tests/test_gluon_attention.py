"""The Gluon FP8 flash-attention forward (graphquant.kernels.gluon_attention).

On the CPU: compiled for Hopper (sm_90; Gluon kernels do not run under Triton's interpreter), it
spills nothing, its wgmmas are not serialized, and its key loop keeps the tensor cores busy beside
the softmax. On the GPU: its outputs are the Triton forward's bit for bit (which
tests/test_triton_attention.py holds to the emulation's bound), and a compiled model runs it where
the plan chose it (tests/test_triton_attention.py tests that choice on the CPU).
"""

import dataclasses
import os
import re
import subprocess
import tempfile

import ptxas
import pytest
import torch

GPU_CASES = [  # batch, heads, kv heads, Lq, Lk (a multiple of 16), head dim
    (2, 8, 2, 1008, 1008, 128),  # grouped, lengths that do not tile
    (1, 4, 4, 2048, 2048, 128),  # whole tiles, many of them
    (2, 4, 2, 300, 704, 64),  # more keys than queries, head dim 64
    (4, 16, 4, 1000, 1008, 128),  # more programs than SMs, causal ones longest first
]


def _compiled_for_sm90(causal: bool, head_dim: int, config, groups: int = 1):
    """gluon_attention's kernel compiled for Hopper (on any machine) for bf16 outputs, the key length
    a multiple of 16 (as ``forward`` takes it)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from graphquant.kernels import gluon_attention, triton_attention

    kernel = gluon_attention._forward_kernel
    constants = dict(HEADS=4 * groups, GROUPS=groups, HEAD_DIM=head_dim, CAUSAL=causal, BLOCK_M=triton_attention.TILE_ROWS,
                     BLOCK_N=triton_attention.TILE_KEYS, STAGES=config.num_stages, OPERAND_ORDER=config.operand_order,
                     SPECIALIZED=config.warp_specialize)
    pointers = dict(Q="*fp8e4nv", K="*fp8e4nv", VT="*fp8e4nv", O="*bf16", LSE="*fp32", SCALE_INV="*fp32", P_SCALE="*fp32")
    strides = dict.fromkeys(("vt_stride", "o_batch_stride", "o_head_stride", "o_row_stride"), "i32")
    signature = {**pointers, "softmax_scale": "fp32", "seq_q": "i32", "seq_k": "i32", **strides, "section": "i32",
                 **dict.fromkeys(constants, "constexpr")}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names) if name in {*pointers, "seq_k", *strides}}
    return triton.compile(GluonASTSource(kernel, signature, constants, aligned), target=GPUTarget("cuda", 90, 64),
                          options={"num_warps": gluon_attention.launch_warps(config)})


def _sass(cubin: bytes) -> list[tuple[int, str]]:
    """The kernel's SASS instructions and their addresses, in order (cuobjdump from Triton's wheel)."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as folder:
        with open(f"{folder}/kernel.cubin", "wb") as file:
            file.write(cubin)
        cuobjdump = os.path.join(os.path.dirname(get_ptxas(90).path), "cuobjdump")
        listing = subprocess.run([cuobjdump, "-sass", f"{folder}/kernel.cubin"], capture_output=True, text=True, check=True).stdout
    return [(int(m.group(1), 16), " ".join(m.group(2).split())) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", listing)]


_PV = re.compile(r"QGMMA\S* R\d+, R(\d+), gdesc")  # a wgmma whose A operand is in registers: P (its first register captured)


def loops_issuing(sass: list[tuple[int, str]], wgmma: re.Pattern) -> list[list[str]]:
    """Each loop's instructions that issues a ``wgmma`` (one a consumer partition's where the loop
    is warp-specialized), in order: the spans from a backward branch's target to it, shortest first,
    each overlapping none taken before it (the partitions' dispatch branches span several loops, an
    mbarrier wait's retry, placed after the kernel's code, branches back into one)."""
    spans = [(int(m.group(1), 16), address) for address, instruction in sass
             if (m := re.search(r"\bBRA (0x[0-9a-f]+)", instruction)) and int(m.group(1), 16) < address]
    loops = []
    for a, b in sorted(spans, key=lambda span: span[1] - span[0]):
        if any(a <= address <= b and wgmma.search(i) for address, i in sass) and all(b < c or d < a for c, d in loops):
            loops.append((a, b))
    return [[instruction for address, instruction in sass if a <= address <= b] for a, b in sorted(loops)]


def _events(loop: list[str]) -> str:
    """The key loop as a string of what the schedule is about: Q a wgmma of QK^T (both operands in
    shared memory), P one of PV (P from registers), E an exponential, M a max, 1 a wait until one
    group of wgmmas is left in flight, 0 a wait for all, B a CTA barrier."""
    kinds = [("QGMMA", lambda i: "P" if _PV.search(i) else "Q"), ("MUFU.EX2", "E"), ("FMNMX", "M"),
             ("WARPGROUP.DEPBAR.LE gsb0, 0x1", "1"), ("WARPGROUP.DEPBAR.LE gsb0, 0x0", "0"), ("BAR.SYNC", "B")]
    events = []
    for instruction in loop:
        for opcode, kind in kinds:
            if opcode in instruction:
                events.append(kind(instruction) if callable(kind) else kind)
    return "".join(events)


SM90_CASES = [  # head dim, groups, causal, operand order, warp-specialized
    *[(d, g, causal, order, False) for d, g in ((128, 1), (128, 4), (64, 1)) for causal in (False, True) for order in (False, True)],
    # warp-specialized, but not key order under a causal mask at head dim 128: no default runs it, and at the consumers' 232
    # registers ptxas reloads a spilled value there every tile
    *[(d, 1, causal, order, True) for d in (128, 64) for causal in (False, True) for order in (False, True) if (d, causal, order) != (128, True, False)],
]


@pytest.mark.parametrize("head_dim, groups, causal, operand_order, specialized", SM90_CASES,
                         ids=[f"d{d}-g{g}-{'causal' if c else 'full'}-{'operand' if o else 'key'}-order{'-ws' if w else ''}" for d, g, c, o, w in SM90_CASES])
def test_key_loop_overlaps_the_tensor_cores_with_the_softmax_on_sm90(head_dim, groups, causal, operand_order, specialized):
    """Compiled for Hopper at 5 stages, the kernel's key loop spills nothing and ptxas serializes no
    wgmma; the next tile's QK^T (head_dim / 32 wgmmas) is waited for only after PV (four) is issued,
    the next tile's row max runs while PV is in flight, and PV is waited for last (one wgmma
    group left in flight, and none, the only waits); at head dim 128 QK^T is issued before most
    of this tile's 66 exponentials (64 of P, 2 of alpha; ptxas hoists a few above it). While PV
    is in flight nothing overwrites P's registers, which it reads. Warp-specialized, each
    consumer warpgroup has such a loop, with no CTA-wide barrier in it (the partitions meet at
    mbarriers alone)."""
    pytest.importorskip("triton")
    from graphquant.kernels import gluon_attention

    config = gluon_attention.GluonForwardConfig(num_stages=5, operand_order=operand_order, warp_specialize=specialized)
    compiled = _compiled_for_sm90(causal, head_dim, config, groups)
    report = ptxas.report(compiled.asm["ptx"])
    assert "serialized" not in report and (specialized or "0 bytes spill stores" in report), report
    loops = loops_issuing(_sass(compiled.asm["cubin"]), _PV)
    assert len(loops) == (2 if specialized else 1)
    for loop in loops:
        events = _events(loop)
        schedule = re.fullmatch(r"[^QP01]*?(Q[^P01]*)(P[PE]*)[^QP01]*1([^QP01]*)0[^QP01]*", events)
        assert schedule and events.count("E") == 66, events
        beside_qk, pv, beside_pv = schedule.groups()
        assert beside_qk.count("Q") == head_dim // 32 and pv.count("P") == 4 and beside_pv.count("M") >= 64, events
        if head_dim == 128:  # at 64, ptxas hoists the exponentials above the barrier that precedes QK^T
            assert beside_qk.count("E") >= 48, events
        assert not _operand_registers_overwritten(loop)
        if specialized:  # the captured arguments go through the stack, but not in the loop
            assert not [i for i in loop if re.match(r"(STL|LDL)\b", i) or re.fullmatch(r"BAR\.SYNC\S* 0x[0-9a-f]+", i)]


def _operand_registers_overwritten(loop: list[str]) -> list[str]:
    """The instructions that write one of P's registers (PV's A operand: four from each wgmma's
    first source) after PV is issued and before it is waited for, which would change what the
    tensor cores read (ptxas must keep them, as the kernel cannot tell it to: Gluon's wgmma wait
    keeps no 8-bit operand alive)."""
    first = next(i for i, instruction in enumerate(loop) if _PV.search(instruction))
    last = next(i for i in range(first, len(loop)) if "WARPGROUP.DEPBAR.LE gsb0, 0x0" in loop[i])
    operand = {int(m.group(1)) + r for instruction in loop[first:last] if (m := _PV.search(instruction)) for r in range(4)}
    written = []
    for instruction in loop[first:last]:
        m = re.match(r"(?:@!?U?P\w+ )?([A-Z0-9_.]+) R(\d+)\b", instruction)
        if m and not m.group(1).startswith(("QGMMA", "ST", "RED", "ATOM")):
            width = 4 if ".128" in m.group(1) else 2 if (".64" in m.group(1) or ".WIDE" in m.group(1)) else 1
            if operand & set(range(int(m.group(2)), int(m.group(2)) + width)):
                written.append(instruction)
    return written


def test_configurations_refuse_what_the_kernel_cannot_run():
    pytest.importorskip("triton")
    from graphquant.kernels.gluon_attention import GluonForwardConfig

    with pytest.raises(ValueError, match=r"GluonForwardConfig\(num_stages=3, .*\) is not a configuration: num_stages from 4 to 6"):
        GluonForwardConfig(num_stages=3)
    with pytest.raises(ValueError, match=r"heads_a_section=0\) is not a configuration: heads_a_section of at least 1"):
        GluonForwardConfig(heads_a_section=0)


def test_forward_refuses_key_lengths_it_cannot_copy():
    pytest.importorskip("triton")
    from graphquant.kernels import gluon_attention

    codes = _codes(1, 2, 2, 64, 100, 64, device="cpu")
    with pytest.raises(ValueError, match="Gluon FP8 flash attention takes key lengths that are multiples of 16, not 100"):
        gluon_attention.forward(*codes, 0.125, False, torch.bfloat16)


# -- on the GPU ----------------------------------------------------------------------------------

def _codes(b, heads, kv_heads, lq, lk, d, seed=0, device="cuda"):
    """Random E4M3 codes of Q, K and V^T (V^T the transpose of V's rowwise codes), with scale_inv
    and the P scale of the zoo recipe's first step (amax 1)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = ((torch.randn(b, h, n, d, generator=g) * 8).to(torch.float8_e4m3fn).to(device) for h, n in ((heads, lq), (kv_heads, lk), (kv_heads, lk)))
    vt = v.reshape(-1, d).t().contiguous()
    return q, k, vt, torch.tensor([0.05], device=device), torch.tensor([448.0], device=device)


SCHEDULES = {
    "stages4": dict(num_stages=4), "stages6": dict(num_stages=6), "ws": dict(num_stages=5, warp_specialize=True),
    "ws-stages4": dict(num_stages=4, warp_specialize=True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("operand_order", [False, True], ids=["key-order", "operand-order"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", GPU_CASES, ids=[f"b{b}-h{h}/{kv}-{lq}x{lk}-d{d}" for b, h, kv, lq, lk, d in GPU_CASES])
def test_gluon_forward_is_the_triton_forward_bit_for_bit(case, causal, operand_order, schedule):
    """O (bf16), the logsumexp and the amax of the normalised P of the Gluon forward are those of
    the Triton forward in the configuration with the same numerics, bit for bit, in both schedules
    (warps copying the tiles themselves at 4 and 6 stages, and warp-specialized at 5 and 4: ``ws``)."""
    from graphquant.kernels import gluon_attention, triton_attention

    codes = _codes(*case)
    config = gluon_attention.GluonForwardConfig(operand_order=operand_order, **SCHEDULES[schedule])
    gluon = gluon_attention.forward(*codes, case[-1] ** -0.5, causal, torch.bfloat16, config=config)
    expected = triton_attention.forward(*codes, case[-1] ** -0.5, causal, torch.bfloat16, config=gluon_attention.triton_config(config))
    for name, x, y in zip(("O", "logsumexp", "P amax"), gluon, expected):
        differ = x.view(torch.int16 if x.dtype == torch.bfloat16 else torch.int32) != y.view(torch.int16 if y.dtype == torch.bfloat16 else torch.int32)
        assert not differ.any(), f"{name}: {differ.sum().item()} of {differ.numel()} differ, first at {differ.nonzero()[0].tolist()}"


@pytest.mark.gpu
@pytest.mark.parametrize("token_major", [False, True], ids=["head-major", "token-major"])
@pytest.mark.parametrize("specialized", [False, True], ids=["copying", "ws"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gluon_default_is_the_triton_default_bit_for_bit(causal, specialized, token_major):
    """Each side's default configuration for the mask (the Gluon one warp-specialized or not), in
    float32 out: the same bits, the Gluon O also where it is written token by token."""
    from graphquant.kernels import gluon_attention, triton_attention

    codes = _codes(2, 8, 2, 1000, 1008, 128, seed=1)
    config = dataclasses.replace(gluon_attention.default_config(causal), warp_specialize=specialized)
    gluon = gluon_attention.forward(*codes, 128**-0.5, causal, torch.float32, token_major, config=config)
    expected = triton_attention.forward(*codes, 128**-0.5, causal, torch.float32)
    assert gluon[0].transpose(1, 2).is_contiguous() if token_major else gluon[0].is_contiguous()
    assert dataclasses.replace(triton_attention.default_config(causal), qk_ahead=False) == gluon_attention.triton_config(gluon_attention.default_config(causal))
    for name, x, y in zip(("O", "logsumexp", "P amax"), gluon, expected):
        assert torch.equal(x.view(torch.int32), y.view(torch.int32)), name


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_compiled_model_runs_the_gluon_forward(monkeypatch, causal):
    """A compiled decoder with FP8 attention, causal or unmasked (head dim 128, 256 keys; linears in
    high precision), plans the Gluon forward and runs it, not the Triton forward; over two training steps
    its outputs, gradients and delayed scales are those of the same model with the Triton forward
    forced (the plan told Triton has no Gluon), bit for bit: the backward, the Gluon kernel's in
    one and the Triton kernel's in the other (the same bits: two key tiles add into each dQ tile,
    so in one order), recomputes from what the two forwards share."""
    import graphquant
    import models
    from graphquant import zoo
    from graphquant.kernels import backends
    from graphquant.quantizers import IdentityQuantizer
    from graphquant.recipes import CustomRecipe

    recipe = zoo.with_fp8_attention(CustomRecipe(lambda role: IdentityQuantizer()))
    x = torch.randn(2, 256, 256, generator=torch.Generator().manual_seed(0)).cuda()

    def trained():
        model = models.seeded(models.DecoderBlock(dim=256, n_heads=2, hidden=256, attention="sdpa", causal=causal)).cuda()
        compiled = graphquant.compile(model, recipe, backend="aot_eager", dynamic=False)
        outputs = [compiled(x)]
        outputs[0].square().mean().backward()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            outputs.append(compiled(x))
            outputs[1].square().mean().backward()
        ops = {event.key for event in profile.key_averages()}
        forwards = tuple(op in ops for op in ("graphquant::flash_attention", "graphquant::gluon_flash_attention"))
        rows = {(g.backend.name, g.reason) for g in compiled.graphquant.plan.gemms if g.gemm in ("qk", "pv")}
        return rows, forwards, [o.detach() for o in outputs], [p.grad for p in model.parameters()], compiled.graphquant.state_dict()

    assert backends.HAS_GLUON
    rows, forwards, *gluon = trained()
    assert rows == {(backends.GLUON_FLASH_ATTENTION, "")} and forwards == (False, True)
    monkeypatch.setattr(backends, "HAS_GLUON", False)
    rows, forwards, *forced = trained()
    assert rows == {(backends.FLASH_ATTENTION, "the Gluon forward needs Triton with Gluon (triton.experimental.gluon)")} and forwards == (True, False)
    for what, got, expected in zip(("outputs", "gradients"), gluon, forced):
        for i, (a, b) in enumerate(zip(got, expected, strict=True)):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"{what} {i}"
    assert gluon[2].keys() == forced[2].keys() and all(torch.equal(gluon[2][k], forced[2][k]) for k in gluon[2])
