"""The decode GEMM (graphquant.kernels.triton_decode): every format's product at 1 to 16 rows
(MXFP8 and NVFP4: to thousands, in row tiles of 16, 64 and 128) equals the float64 product of
the dequantized operands within fp32 accumulation (FP8 products: within the promoted FP8
accumulation of the tensor cores), with every tiling (DecodeConfig), and the planner picks it for
a static m up to those rows.

On the CPU the kernel runs under Triton's interpreter, in a process of its own (TRITON_INTERPRET
must be set before Triton is first imported); on a GPU at the shapes of a Llama-3-8B FFN.
"""

import json
import re
import unittest.mock

import ptxas
import pytest
import torch
import triton_interpreter
from reference import cuda_graph_of

from graphquant.formats import fp8
from graphquant.kernels import backends
from graphquant.kernels.backends import GemmBackend
from graphquant.quantizers import (
    COLUMNWISE,
    ROWWISE,
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8RowwiseQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)

# (name, the activation's quantizer, the weight's): each built-in rowwise GEMM family.
PAIRS = {
    "fp8 tensorwise": (Float8CurrentScalingQuantizer("e4m3"), Float8CurrentScalingQuantizer("e4m3")),
    "fp8 tensorwise e5m2 x e4m3": (Float8CurrentScalingQuantizer("e5m2"), Float8CurrentScalingQuantizer("e4m3")),
    "fp8 rowwise": (Float8RowwiseQuantizer(), Float8RowwiseQuantizer()),
    "fp8 block 1x128 x 128x128": (Float8BlockQuantizer(block_scaling_dim=1), Float8BlockQuantizer(block_scaling_dim=2)),
    "fp8 block 1x128, scales not powers of two": (
        Float8BlockQuantizer(block_scaling_dim=1, force_pow_2_scales=False),
        Float8BlockQuantizer(block_scaling_dim=1, force_pow_2_scales=False),
    ),
    "mxfp8": (MXFP8Quantizer(), MXFP8Quantizer()),
    "nvfp4 x nvfp4 2d": (NVFP4Quantizer(), NVFP4Quantizer(with_2d_quantization=True)),
    "nvfp4 row-scaled x nvfp4": (NVFP4Quantizer(row_scaled_nvfp4=True), NVFP4Quantizer()),
}

U = 2.0**-24


def excess(
    name: str, m: int, n: int, k: int, with_bias: bool, out_dtype: torch.dtype, device: str, gemm: str = "fprop", config=None
) -> float:
    """How far the decode GEMM's out (m, n) exceeds its bound (<= 0: within it), through
    backends.gemm, which must have chosen it (or, given a ``config``, called with that tiling);
    in a fprop (the weight's rowwise representation) or a dgrad (its columnwise one, stored
    transposed: n is the weight's columns). The bound: the sum's fp8.accumulation_bound (FP8
    products on the GPU promoted every 128 on the tensor cores, any other in fp32), one rounding of
    each dequantized reference operand, the factors' product and its product with the sum (4 u
    sum|a b| together), the bias's addition (u |out|) and the rounding to out_dtype."""
    from graphquant.kernels import triton_decode

    torch.manual_seed(0)
    qa, qb = PAIRS[name]
    x = (torch.randn(m, k) * torch.rand(m, 1) * 8).to(device)
    w = (torch.randn(n, k) * torch.rand(n, 1) / 8).to(device, torch.bfloat16)
    direction = ROWWISE if gemm == "fprop" else COLUMNWISE
    a = qa(x, rowwise=True, columnwise=False).get(ROWWISE)
    b = qb(w if gemm == "fprop" else w.t().contiguous(), rowwise=direction == ROWWISE, columnwise=direction == COLUMNWISE).get(direction)
    bias = (torch.randn(n) * 4).to(device, torch.bfloat16) if with_bias else None
    if config is not None:
        out = triton_decode.gemm(a, b, out_dtype, bias, config)
    elif device == "cuda":  # on the CPU the kernel is called as the GPU's selection would
        # Where graphquant's extension has the mixed-input GEMM, the plan gives it MXFP8's and
        # NVFP4's middle rows; the decode GEMM runs them where it has not.
        decode = GemmBackend(triton_decode.BACKEND)
        selection = backends.select(qa, ROWWISE, qb, direction, torch.device(device), (m, n, k))
        assert selection.backend in (decode, GemmBackend(backends.mixed_input.BACKEND)), selection
        out = backends.gemm(a, b, 1, out_dtype, decode, f"{name} {gemm}", bias)[0]
    else:
        out = triton_decode.gemm(a, b, out_dtype, bias)
    assert out.shape == (m, n) and out.dtype == out_dtype
    left, right = a.gemm_operand(torch.float64), b.gemm_operand(torch.float64)
    ref = left @ right.t() + (bias.double() if with_bias else 0)
    rounding = U if out_dtype == torch.float32 else 2.0**-8
    family = qb.gemm_input(direction).family
    fp8_products = device == "cuda" and triton_decode.LAYOUTS[family].operand == triton_decode.FP8_CODES
    accumulation = fp8.accumulation_bound(left, right.t(), fp8.PROMOTED_PRODUCTS if fp8_products else fp8.FP32)
    bound = accumulation + 4 * U * (left.abs() @ right.abs().t()) + ref.abs() * (U + rounding)
    return ((out.double() - ref).abs() - bound).max().item()


# (m, n, k, bias, out dtype, GEMM): one row, K split in two; rows and K that fill no tile (K not
# a multiple of 128: partial FP8 blocks); a full tile of 16 rows and a partial second split; a
# dgrad; for MXFP8 and NVFP4, 40 rows (a tile of 64, partial) and 128 (a tile of 128, A decoded
# first). fp32 out only: the interpreter rounds fp32 to bf16 toward zero (the GPU
# cases check bf16).
INTERPRETED = [
    (1, 96, 1024, False, torch.float32, "fprop"),
    (3, 40, 224, True, torch.float32, "fprop"),
    (16, 72, 640, True, torch.float32, "fprop"),
    (2, 256, 640, False, torch.float32, "dgrad"),
    (40, 72, 640, True, torch.float32, "fprop"),
    (128, 40, 256, False, torch.float32, "fprop"),
]
# MXFP8's columnwise data keeps x's layout (reduction dim first), which the decode GEMM does not read.
DGRAD_PAIRS = [name for name, (_, qb) in PAIRS.items() if not isinstance(qb, MXFP8Quantizer)]
# The pairs the decode GEMM takes past one tile of 16 rows (MXFP8's and NVFP4's, decoded in registers).
MIDDLE_ROW_PAIRS = [name for name, (_, qb) in PAIRS.items() if isinstance(qb, (MXFP8Quantizer, NVFP4Quantizer))]


def _max_rows(name: str) -> int:
    from graphquant.kernels import triton_decode

    qa, qb = PAIRS[name]
    return triton_decode.MAX_ROWS[(qa.gemm_input(ROWWISE).family, qb.gemm_input(ROWWISE).family)]


def _interpreted_id(case) -> str:
    m, n, k, bias, dtype, gemm = case
    return f"{gemm} {m}x{n}x{k}{' bias' if bias else ''} {str(dtype).removeprefix('torch.')}"


def _interpreted_cases():
    return [
        (name, case)
        for name in PAIRS
        for case in INTERPRETED
        if (case[-1] == "fprop" or name in DGRAD_PAIRS) and (case[0] <= 16 or name in MIDDLE_ROW_PAIRS)
    ]


def _configs() -> dict:
    """The tilings other than the default that each dequantized pair is also tested with, by name
    (tl.dot_scaled's only on the GPU: Triton's interpreter has no tl.dot_scaled)."""
    from graphquant.kernels.triton_decode import DecodeConfig

    # A decoded by its own kernel first, and a tile of 128 rows of A decoded in each program
    values = {
        "a first": DecodeConfig(block_k=128, a_first=True),
        "a in programs": DecodeConfig(128, 128, 128, 8),
        "one dot": DecodeConfig(64, 128, 16, 4, a_first=True, one_dot=True),
    }
    return {
        "mxfp8": {"block sums": DecodeConfig(block_k=128, mx_products="block sums"), "fma": DecodeConfig(16, 128, 1, fma=True), **values},
        "nvfp4 x nvfp4 2d": {"fma": DecodeConfig(16, 128, 1, fma=True), **values},
        "nvfp4 row-scaled x nvfp4": {"fma": DecodeConfig(16, 128, 1, fma=True), **values},
    }


def _config_cases():
    """(pair, tiling's name, case): one row, K split; three rows, a partial tile of them, K a
    partial chunk; with a bias; with A decoded first, also 40 rows (three tiles of 16) whose K
    splits in three of 1024 columns, the last reaching past K (2560)."""
    cases = [(1, 96, 1024, False, torch.float32, "fprop"), (3, 40, 640, True, torch.float32, "fprop")]
    past_k = (40, 64, 2560, True, torch.float32, "fprop")
    return [
        (name, config, case)
        for name, configs in _configs().items()
        for config in configs
        for case in cases + ([past_k] if configs[config].a_first else [])
    ]


@pytest.fixture(scope="module")
def interpreted() -> dict:
    """Every (pair, case)'s excess, from one process running the kernel under Triton's interpreter."""
    pytest.importorskip("triton")
    return triton_interpreter.results_of(__file__)


@pytest.mark.parametrize("name,case", _interpreted_cases(), ids=[f"{name}-{_interpreted_id(case)}" for name, case in _interpreted_cases()])
def test_decode_gemm_matches_float64_reference_interpreted(interpreted, name, case):
    assert interpreted[f"{name} | {_interpreted_id(case)}"] <= 0


@pytest.mark.parametrize(
    "name,config,case",
    [
        (name, c, case)
        for name in ("mxfp8", "nvfp4 x nvfp4 2d", "nvfp4 row-scaled x nvfp4")
        for c in ("block sums", "fma", "a first", "a in programs", "one dot")
        for case in ("1x96x1024", "3x40x640", "40x64x2560")
        if (c != "block sums" or name == "mxfp8") and (case != "40x64x2560" or c in ("a first", "one dot"))
    ],
)
def test_decode_gemm_tilings_match_float64_reference_interpreted(interpreted, name, config, case):
    """MXFP8's block sums (tensor cores), MXFP8 and NVFP4 on the FMA units (one row of A a
    program: three rows, three programs), and on the tensor cores with A decoded first by a kernel
    of its own (its K padded to whole chunks), in pairs or in K's own order (one dot a step), or
    in each program of a tile of 128 rows."""
    assert interpreted[f"{name} | {config} | {case}"] <= 0


@pytest.mark.gpu
@pytest.mark.parametrize("with_bias", [False, True], ids=["no bias", "bias"])
@pytest.mark.parametrize("m", [1, 2, 16, 40, 64, 128])
@pytest.mark.parametrize("name", PAIRS)
def test_decode_gemm_matches_float64_reference_on_gpu(name, m, with_bias):
    """At the shape of a Llama-3-8B FFN's down projection (K split across programs), up to the
    pair's most rows: every row tiling (VALUE_TILES)."""
    if m > _max_rows(name):
        pytest.skip(f"the decode GEMM takes at most {_max_rows(name)} rows of {name}")
    assert excess(name, m, 4096, 14336, with_bias, torch.bfloat16, "cuda") <= 0


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(300, 4096, 14336), (2048, 1024, 4096)])
@pytest.mark.parametrize("name", MIDDLE_ROW_PAIRS)
def test_decode_gemm_matches_float64_reference_in_several_row_tiles_on_gpu(name, m, n, k):
    """The largest tiling (tiles of 128 rows, A decoded first) given more rows than the plan
    gives it: 3 and 16 row tiles, K split so that the last split's steps reach past K (A's values
    there must read as zeros; they read past the values once, and the product was NaN)."""
    from graphquant.kernels import triton_decode

    assert excess(name, m, n, k, True, torch.bfloat16, "cuda", config=triton_decode.VALUE_TILES[-1][1]) <= 0


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name,config,m",
    [("mxfp8", config, m) for config in ("block sums", "dot scaled") for m in (1, 4, 16)]
    + [(name, "fma", m) for name in ("mxfp8", "nvfp4 x nvfp4 2d") for m in (1, 4)]
    + [(name, config, m) for name in ("mxfp8", "nvfp4 x nvfp4 2d") for config in ("a first", "a in programs") for m in (16, 128)],
)
def test_decode_gemm_tilings_match_float64_reference_on_gpu(name, config, m):
    """Every other way the decode GEMM can multiply MXFP8 and NVFP4, at the down projection's
    shape: MXFP8's block sums and tl.dot_scaled, the FMA units, A decoded first at 16 rows, and a
    tile of 128 rows with A decoded in every program."""
    from graphquant.kernels.triton_decode import DecodeConfig

    tiling = {
        "block sums": DecodeConfig(mx_products="block sums"),
        "dot scaled": DecodeConfig(mx_products="dot scaled"),
        "fma": DecodeConfig(32, 256, 1, fma=True, tiles_per_sm=4),
        "a first": DecodeConfig(block_k=128, a_first=True),
        "a in programs": DecodeConfig(128, 128, 128, 8, tiles_per_sm=2),
    }[config]
    assert excess(name, m, 4096, 14336, True, torch.bfloat16, "cuda", config=tiling) <= 0


@pytest.mark.gpu
@pytest.mark.parametrize("name", DGRAD_PAIRS)
def test_decode_dgrad_matches_float64_reference_on_gpu(name):
    """A dgrad of 16 rows reads the weight's columnwise representation (stored transposed)."""
    assert excess(name, 16, 4096, 14336, False, torch.bfloat16, "cuda", "dgrad") <= 0


@pytest.mark.gpu
def test_decode_gemm_gives_the_same_bits_every_run():
    """The K splits' partial sums are added in a fixed order, with no atomics."""
    from graphquant.kernels import triton_decode

    qa, qb = PAIRS["nvfp4 x nvfp4 2d"]
    a = qa(torch.randn(4, 14336, device="cuda"), columnwise=False).get(ROWWISE)
    b = qb(torch.randn(4096, 14336, device="cuda"), columnwise=False).get(ROWWISE)
    assert triton_decode.split_k(4096, 14336, a.data.device) > 1
    first = triton_decode.gemm(a, b, torch.float32)
    assert torch.equal(first, triton_decode.gemm(a, b, torch.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["nvfp4 x nvfp4 2d", "mxfp8"])
@pytest.mark.parametrize("m", [1, 16])
def test_a_dependent_launch_reads_a_as_the_kernel_before_it_left_it(name, m):
    """Every decode GEMM is launched dependent on the kernel before it (Hopper's PDL) and starts
    while that kernel runs; it must still read A as that kernel leaves it. A's quantize (whose
    small program lets its dependents start as soon as it begins) runs behind a spinning kernel,
    then the GEMM, eagerly and in CUDA graph replays, each replay on a new x: each product is the
    one of that x's codes made and multiplied one kernel at a time (a GEMM that read A early would
    give the last x's, or a partly written A's)."""
    from graphquant.kernels import triton_decode

    qa, qb = PAIRS[name]
    b = qb(torch.randn(14336, 4096, device="cuda"), columnwise=False).get(ROWWISE)
    x = torch.empty(m, 4096, device="cuda", dtype=torch.bfloat16)

    def step():
        torch.cuda._sleep(1 << 20)
        return triton_decode.gemm(qa(x, columnwise=False).get(ROWWISE), b, torch.float32)

    def alone(new_x):
        a = qa(new_x, columnwise=False).get(ROWWISE)
        torch.cuda.synchronize()
        return triton_decode.gemm(a, b, torch.float32)

    generator = torch.Generator(device="cuda").manual_seed(0)
    new_xs = [torch.randn(m, 4096, device="cuda", generator=generator).to(torch.bfloat16) for _ in range(6)]
    for new_x in new_xs[:2]:
        x.copy_(new_x)
        assert torch.equal(step(), alone(new_x))
    graph, out = cuda_graph_of(step)
    for new_x in new_xs[2:]:
        x.copy_(new_x)
        graph.replay()
        assert torch.equal(out, alone(new_x))


def _decode_variants(capability: int, dependent: bool) -> list:
    """The decode kernels compiled for sm_``capability``, as dependent launches or not: FP8 codes
    quantizing A as they load it, NVFP4 and MXFP8 (decoded to bf16 by inline PTX) on the tensor
    cores, and NVFP4 and MXFP8 on the FMA units at one row."""
    from graphquant.kernels import triton_decode

    fp8_pointers = {"a_ptr": "*bf16", "b_ptr": "*fp8e4nv", "bias_ptr": "*bf16", "out_ptr": "*bf16"}
    fp8_runtime = {"M": 1, "has_bias": 0, "k_chunks": 1, "N": 14336, "K": 4096, "a_stride": 4096, "b_stride": 4096}
    rule = triton_decode._rule(Float8CurrentScalingQuantizer("e4m3"), 8)
    nvfp4_pointers = {"a_ptr": "*i64", "b_ptr": "*i64", "a_scale_ptr": "*fp8e4nv", "b_scale_ptr": "*fp8e4nv", "bias_ptr": "*bf16", "out_ptr": "*bf16"}
    nvfp4_runtime = {"M": 1, "has_bias": 0, "k_chunks": 1, "N": 14336, "K": 4096, "a_stride": 256, "b_stride": 256,
                     "a_scale_row_stride": 256, "b_scale_row_stride": 256, "a_scale_col_stride": 1, "b_scale_col_stride": 1}
    mxfp8_pointers = {**nvfp4_pointers, "a_scale_ptr": "*u8", "b_scale_ptr": "*u8"}
    given = dict(capability=capability, DEPENDENT=dependent)
    return [
        _decode_kernel_compiled(fp8_pointers, fp8_runtime, OPERAND=triton_decode.FP8_CODES, SCALE_COLS=0, A_DIVISOR=1.0, B_DIVISOR=1.0,
                                A_RULE=rule, **given),
        _decode_kernel_compiled(nvfp4_pointers, nvfp4_runtime, OPERAND=triton_decode.F16_VALUES, SCALE_COLS=16, A_DIVISOR=2688.0,
                                B_DIVISOR=2688.0, **given),
        _decode_kernel_compiled(mxfp8_pointers, {**nvfp4_runtime, "M": 16, "a_stride": 512, "b_stride": 512, "a_scale_row_stride": 128,
                                "b_scale_row_stride": 128}, OPERAND=triton_decode.BF16_VALUES, SCALE_COLS=32, A_DIVISOR=1.0,
                                B_DIVISOR=1.0, **given),
        _fma_kernel_compiled(nvfp4_pointers, nvfp4_runtime, triton_decode.F16_VALUES, 2688.0, 512, **given),
        _fma_kernel_compiled(mxfp8_pointers, {**nvfp4_runtime, "a_stride": 512, "b_stride": 512}, triton_decode.BF16_VALUES, 1.0, 256, **given),
    ]


def test_decode_kernels_wait_for_the_kernel_before_them_before_they_read_a_on_sm90():
    """Compiled for Hopper as dependent launches (on any machine with Triton), each decode
    program waits for the kernel before it (griddepcontrol.wait) before any load, copy, store or
    atomic: nothing before the wait reads what that kernel may still write (A, its scales or
    amaxes) or writes what it may still read."""
    pytest.importorskip("triton")
    for kernel in _decode_variants(90, dependent=True):
        ptx = kernel.asm["ptx"]
        wait = ptx.index("griddepcontrol.wait")
        memory = re.search(r"\b(ld\.global|cp\.async\.cg|st\.global|atom\.|red\.)", ptx[:wait])
        assert memory is None, ptx[max(0, memory.start() - 200):memory.end() + 50]


def test_decode_kernels_assemble_for_sm89_as_launches_that_follow_the_last():
    """The decode GEMM serves sm_89 GPUs too, whose PTX has neither griddepcontrol nor
    mul.bf16x2 (MXFP8's decode multiplies by fma with a -0 addend, which sm_90 assembles to the
    same multiply): launched there the kernels are not dependent launches, and compiled so they
    assemble for it; the launch asks for dependent ones from sm_90 on, and never in the
    interpreter."""
    pytest.importorskip("triton")
    from graphquant.kernels import devices, triton_launch

    for kernel in _decode_variants(89, dependent=False):
        assert "griddepcontrol" not in kernel.asm["ptx"] and kernel.asm["cubin"]
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    for capability, expected in (((8, 9), False), ((9, 0), True), ((10, 0), True)):
        devices._of.cache_clear()
        with unittest.mock.patch.object(torch.cuda, "get_device_capability", return_value=capability):
            assert triton_launch.dependent_launch(cuda) == {"DEPENDENT": expected, "launch_pdl": expected}
            assert not triton_launch.dependent_launch(cpu)["DEPENDENT"]


def _fma_kernel_compiled(pointers: dict, runtime: dict, operand: int, divisor: float, block_k: int, capability: int = 90, **constants):
    """_fma_kernel compiled (as _decode_kernel_compiled) over a 64-row weight tile."""
    from graphquant.kernels import triton_decode

    constants = dict(
        CHUNK=triton_decode.K_CHUNK, OPERAND=operand, A_FACTOR=1, A_DIVISOR=divisor, B_FACTOR=1, B_DIVISOR=divisor, SPLIT=True,
        ASM=True, WHOLE_TILES=True, BLOCK_N=64, BLOCK_K=block_k, STAGES=1, GEMMS=1, DEPENDENT=False,
    ) | constants
    return ptxas.compiled_for(
        triton_decode._fma_kernel, {"arrivals_ptr": "*i32", **pointers}, runtime, constants, num_warps=4, num_stages=1, capability=capability
    )


def test_decode_kernel_reads_fp8_weights_in_16_byte_copies_on_sm90():
    """The kernel compiled for Hopper (on any machine: Triton compiles without a GPU) copies the
    weight's codes 16 bytes at a time, asynchronously: every split of K starts at a column the
    compiler knows to be aligned. A split length it cannot see turns every load into a byte load,
    at a quarter of the speed. A lone GEMM's launch leaves the later GEMMs' arguments (GEMMS) at
    their defaults (None pointers), so the code for a second or third GEMM must not be compiled
    for it."""
    pytest.importorskip("triton")
    import inspect

    from graphquant.kernels import triton_decode

    pointers = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "bias_ptr": "*bf16", "out_ptr": "*bf16"}
    runtime = {"M": 1, "has_bias": 0, "k_chunks": 1, "N": 14336, "K": 4096, "a_stride": 4096, "b_stride": 4096}
    parameters = inspect.signature(triton_decode._decode_kernel.fn).parameters
    later = [name for names in triton_decode._LATER_GEMMS_ARGUMENTS for name in names]
    lone = {name: None for name in later if name.endswith("_ptr") and parameters[name].default is None}
    ptx = _decode_kernel_compiled(
        pointers, runtime, OPERAND=triton_decode.FP8_CODES, SCALE_COLS=0, A_DIVISOR=1.0, B_DIVISOR=1.0, **lone
    ).asm["ptx"]
    assert "cp.async.cg.shared.global" in ptx and "ld.global.b8" not in ptx


@pytest.mark.parametrize("gemms", [2, 3])
def test_gemms_in_one_launch_read_their_fp8_weights_in_16_byte_copies_on_sm90(gemms):
    """The kernel that runs two or three GEMMs of one A (GEMMS: each program picks its weight's
    pointer and rows from its program id) keeps the single GEMM's 16-byte asynchronous copies:
    every weight's pointer and strides are aligned, so the one it picks is too; and it spills
    nothing."""
    pytest.importorskip("triton")
    from graphquant.kernels import triton_decode

    pointers = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "bias_ptr": "*bf16", "out_ptr": "*bf16"}
    runtime = {"M": 1, "has_bias": 0, "k_chunks": 4, "N": 14336, "K": 4096, "a_stride": 4096, "b_stride": 4096}
    for i in range(2, gemms + 1):
        pointers |= {f"b{i}_ptr": "*fp8e4nv", f"bias{i}_ptr": "*bf16", f"out{i}_ptr": "*bf16"}
        runtime |= {f"has_bias{i}": 0, f"N{i}": 14336, f"b{i}_stride": 4096}
    unused = {name: None for names in triton_decode._LATER_GEMMS_ARGUMENTS[gemms - 1:] for name in names if name.endswith("_ptr")}
    constants = dict(OPERAND=triton_decode.FP8_CODES, SCALE_COLS=0, A_DIVISOR=1.0, B_DIVISOR=1.0, GEMMS=gemms, **unused)
    ptx = _decode_kernel_compiled(pointers, runtime, **constants).asm["ptx"]
    assert "cp.async.cg.shared.global" in ptx and "ld.global.b8" not in ptx
    assert "0 bytes spill stores" in ptxas.report(ptx)


def _decode_kernel_compiled(pointers: dict, runtime: dict, num_warps: int = 4, capability: int = 90, **constants):
    """_decode_kernel compiled (ptxas.compiled_for; for Hopper unless told) over a 64x256 weight tile,
    16 rows of A, a K split, factors (unless given)."""
    from graphquant.kernels import triton_decode

    constants = dict(
        CHUNK=triton_decode.K_CHUNK, A_SCALE_ROWS=1, B_SCALE_ROWS=1, A_FACTOR=1, B_FACTOR=1,
        SPLIT=True, PROMOTE_EVERY=fp8.PROMOTED_PRODUCTS, MX=0, A_FORMAT="", B_FORMAT="", ASM=True, WHOLE_TILES=True, BLOCK_M=16, BLOCK_N=64,
        BLOCK_K=256, A_RULE=None, A_VALUES=False, ONE_DOT=False, GEMMS=1, DEPENDENT=False,
    ) | constants
    return ptxas.compiled_for(
        triton_decode._decode_kernel, {"arrivals_ptr": "*i32", **pointers}, runtime, constants, num_warps=num_warps, num_stages=3,
        capability=capability,
    )


def _e2m1_ptx_pairs(words: torch.Tensor) -> dict[int, torch.Tensor]:
    """triton_dequantize's E2M1 PTX (_e2m1_pair_lines), its integer steps emulated with the same
    constants, on 32-bit ``words`` of 8 codes: for each c of 0..3, the f16x2 pairs (as fp16 of
    shape (words, 2)) holding codes c and c + 4 times 2^-14."""
    from graphquant.kernels import triton_dequantize as dq

    def select(a, b, c):  # lop3 with truth table SELECT
        assert dq.SELECT == 0xE4
        return (a & c) | (b & ~c & 0xFFFFFFFF)

    def halves(word):  # the two fp16 of each 32-bit word, low half first
        bits = torch.stack((word & 0xFFFF, word >> 16), dim=-1)
        return ((bits + 32768) % 65536 - 32768).to(torch.int16).view(torch.float16)

    assert dq.PRMT_SWAP == 0x2301  # bytes B1 B0 B3 B2
    y = ((words & 0x00FF00FF) << 8) | ((words >> 8) & 0x00FF00FF)
    even = select((y << 1) & 0xFFFFFFFF, (y << 4) & 0xFFFFFFFF, dq.CODE_BITS)
    odd = select(y >> 3, y, dq.CODE_BITS)
    decoded = {0: even & dq.PAIR_BITS, 2: (even << 8) & dq.PAIR_BITS, 1: odd & dq.PAIR_BITS, 3: (odd << 8) & dq.PAIR_BITS}
    return {code: halves(word) for code, word in decoded.items()}


def test_e2m1_ptx_decodes_every_pair_of_codes_at_every_scale_exactly():
    """The inline PTX that decodes NVFP4 for the decode GEMM (triton_dequantize.e2m1_block_values),
    its integer steps emulated here with the same constants: every pair of bytes that meet in
    one f16x2 (bytes 0 and 2, 1 and 3 of a 32-bit word, among random neighbours), times every
    finite E4M3 scale, gives each code's reference value times 2^-14 (zeros' signs included)."""
    pytest.importorskip("triton")
    from graphquant.formats import nvfp4

    generator = torch.Generator().manual_seed(0)
    every = torch.arange(65536, dtype=torch.int64)
    pairs = (every & 0xFF) | ((every >> 8) << 16)  # every (byte 0, byte 2)
    neighbours = torch.randint(0, 256, (2, every.numel()), generator=generator, dtype=torch.int64)
    words = torch.cat((pairs | (neighbours[0] << 8) | (neighbours[1] << 24), (pairs << 8) | neighbours[0] | (neighbours[1] << 16)))
    scales = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float16)
    scales = scales[scales.isfinite() & ~scales.signbit()]
    for code, pair in _e2m1_ptx_pairs(words).items():  # codes ``code`` and ``code + 4`` of each word
        got = (pair[:, None, :] * scales[None, :, None]).double()
        codes = torch.stack(((words >> 4 * code) & 0xF, (words >> 4 * (code + 4)) & 0xF), dim=-1)
        want = nvfp4.e2m1_values(codes)[:, None, :].double() * scales[None, :, None].double() * 2.0**-14
        assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit()), f"codes {code} and {code + 4}"


def test_e2m1_block_dot_ptx_sums_every_product_exactly():
    """The PTX of triton_dequantize.e2m1_block_dot (the one-row NVFP4 GEMM's products), emulated:
    the weight word's pairs as decoded (times 2^-14), the other word's pairs times 2^14
    (e2m1_pairs), multiplied and summed by f16x2 fma in the PTX's order, never round (each fma's
    exact result is an fp16), so the fp32 total is the exact sum of the 16 products times 2^-14:
    on random words, and on words of the largest codes of one sign, whose sums are the largest."""
    pytest.importorskip("triton")
    from graphquant.formats import nvfp4
    from graphquant.kernels import triton_dequantize as dq

    generator = torch.Generator().manual_seed(1)
    random = torch.randint(0, 2**32, (2, 2, 4096), generator=generator, dtype=torch.int64)  # (operand, half, word)
    largest = torch.tensor([0x77777777, 0xFFFFFFFF], dtype=torch.int64)  # codes of 6 and of -6
    extremes = torch.stack(torch.meshgrid(largest, largest, indexing="ij")).reshape(2, 1, 4).expand(2, 2, 4)
    b_words, a_words = torch.cat((random, extremes), dim=2)
    order = [code for _, code in dq._e2m1_pair_lines("w", "h")]
    assert sorted(order) == [0, 1, 2, 3]
    up = torch.tensor(2.0**14, dtype=torch.float16)
    total = torch.zeros(b_words.shape[1], 2, dtype=torch.float64)
    for half in range(2):
        b_pairs, a_pairs = _e2m1_ptx_pairs(b_words[half]), _e2m1_ptx_pairs(a_words[half])
        for code in order:
            a_values = a_pairs[code] * up
            assert torch.equal(a_values.double(), a_pairs[code].double() * 2.0**14)
            total = total + b_pairs[code].double() * a_values.double()  # the fma in float64
            assert torch.equal(total.to(torch.float16).double(), total), "an f16x2 fma rounded"
    got = total.sum(dim=1).float().double()

    def values(words):  # (word, 16) reference values, column j of the 64-bit word at j
        codes = torch.stack([(words[half] >> 4 * j) & 0xF for half in range(2) for j in range(8)], dim=-1)
        return nvfp4.e2m1_values(codes).double()

    want = (values(b_words) * values(a_words)).sum(dim=1) * 2.0**-14
    assert torch.equal(got, want)
    assert want[-4:].abs().max() == 16 * 36 * 2.0**-14


def test_e4m3_ptx_decodes_every_pair_of_codes_at_every_scale_exactly():
    """The inline PTX that decodes MXFP8 for the decode GEMM (triton_dequantize.e4m3_bf16_word_values),
    its integer steps emulated here with the same constants: every pair of bytes that meet in one
    bf16x2 (bytes 0 and 1, 2 and 3 of a 32-bit word, among random neighbours) gives each code's
    value times 2^-120 (subnormals as bf16 subnormals, zeros' signs kept; a NaN code reads as 480,
    which its block's NaN scale overrides), and the two bf16 multiplies, by 2^120 and by each E8M0
    scale, give the emulation's value (the code times the scale in fp32, rounded to bf16)."""
    pytest.importorskip("triton")
    from graphquant.formats import mxfp8
    from graphquant.kernels import triton_dequantize as dq

    def prmt(a, selector):  # prmt.b32 d, a, 0, selector: byte i of d is byte (nibble i) of (a, 0)
        picked = [(a >> 8 * nibble) & 0xFF if nibble < 4 else torch.zeros_like(a) for nibble in ((selector >> 4 * i) & 0xF for i in range(4))]
        return picked[0] | (picked[1] << 8) | (picked[2] << 16) | (picked[3] << 24)

    def lop3(a, b, c, table):  # bit by bit, table[(a << 2) | (b << 1) | c]
        out = torch.zeros_like(a)
        for index in range(8):
            if table >> index & 1:
                out |= (a if index & 4 else ~a) & (b if index & 2 else ~b) & (c if index & 1 else ~c)
        return out & 0xFFFFFFFF

    def halves(word):  # the two bf16 of each 32-bit word, low half first
        bits = torch.stack((word & 0xFFFF, word >> 16), dim=-1)
        return ((bits + 32768) % 65536 - 32768).to(torch.int16).view(torch.bfloat16)

    generator = torch.Generator().manual_seed(0)
    every = torch.arange(65536, dtype=torch.int64)  # every (first byte, second byte)
    neighbours = torch.randint(0, 65536, (every.numel(),), generator=generator, dtype=torch.int64)
    for selector, shift in ((dq.PRMT_CODES_01, 0), (dq.PRMT_CODES_23, 16)):
        words = (every << shift) | (neighbours << (16 - shift))
        p = prmt(words, selector)
        t = lop3((p >> 4) & dq.E4M3_MAGNITUDE, torch.full_like(p, 0x80008000), p, dq.SIGN_OR)
        got = halves(t)
        codes = torch.stack((every & 0xFF, every >> 8), dim=-1).to(torch.uint8)
        want = codes.view(torch.float8_e4m3fn).double()
        nan = want.isnan()
        want = torch.where(nan, torch.where(codes >= 128, -480.0, 480.0).double(), want)
        assert torch.equal(got.double() * 2.0**120, want) and torch.equal(got.signbit(), codes >= 128)
        two_120 = halves(torch.tensor(dq.BF16X2_2_POW_120))
        assert torch.equal(two_120.double(), torch.full((2,), 2.0**120, dtype=torch.float64))
        values = (got * two_120[0])[~nan]
        for biased in range(255):
            scale = mxfp8.decode_scale(torch.tensor([biased], dtype=torch.uint8))
            assert torch.equal(values * scale.to(torch.bfloat16), (values.float() * scale).to(torch.bfloat16)), biased


def test_nvfp4_decode_kernel_reads_16_byte_words_and_decodes_them_in_f16x2_on_sm90():
    """Compiled for Hopper (on any machine), the decode GEMM's NVFP4 program copies the weight's
    blocks 16 bytes at a time, asynchronously, and decodes them two values an f16x2 multiply,
    straight into the tensor cores' operand layout (the decoded weight makes no round trip
    through shared memory)."""
    pytest.importorskip("triton")
    from graphquant.kernels import triton_decode

    pointers = {"a_ptr": "*u8", "b_ptr": "*u8", "a_scale_ptr": "*fp8e4nv", "b_scale_ptr": "*fp8e4nv", "bias_ptr": "*bf16", "out_ptr": "*bf16"}
    runtime = {"M": 1, "has_bias": 0, "k_chunks": 1, "N": 14336, "K": 4096, "a_stride": 256, "b_stride": 256,
               "a_scale_row_stride": 256, "b_scale_row_stride": 256, "a_scale_col_stride": 1, "b_scale_col_stride": 1}
    compiled = _decode_kernel_compiled(pointers, runtime, OPERAND=triton_decode.F16_VALUES, SCALE_COLS=16, A_DIVISOR=2688.0, B_DIVISOR=2688.0)
    ptx, ttgir = compiled.asm["ptx"], compiled.asm["ttgir"]
    assert re.search(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10", ptx)
    assert "mul.rn.f16x2" in ptx and "wgmma" in ptx
    _assert_only_a_through_shared_memory(ttgir, "f16", 16, 64)


def _assert_only_a_through_shared_memory(ttgir: str, dtype: str, a_rows: int, b_rows: int) -> None:
    """Only A's decoded tiles go through shared memory, never the weight's: every decoded tile
    copied there is (K, a_rows), A's made transposed, none (b_rows, K)."""
    shapes = re.findall(rf"local_alloc %\S+ : \(tensor<((?:\d+x)+){dtype}", ttgir)
    assert shapes and all(shape.split("x")[-2] == str(a_rows) for shape in shapes), (shapes, b_rows)


# MXFP8's operands as the decode GEMM reads them (codes and E8M0 scales), at the FFN's first weight.
_MXFP8_POINTERS = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "a_scale_ptr": "*u8", "b_scale_ptr": "*u8", "bias_ptr": "*bf16", "out_ptr": "*bf16"}
_MXFP8_RUNTIME = {"M": 16, "has_bias": 0, "k_chunks": 1, "N": 14336, "K": 4096, "a_stride": 512, "b_stride": 512,
                  "a_scale_row_stride": 128, "b_scale_row_stride": 128, "a_scale_col_stride": 1, "b_scale_col_stride": 1}


@pytest.mark.parametrize(
    "block_m,block_n,block_k,warps,a_first,one_dot",
    [(16, 64, 256, 4, False, False), (64, 64, 128, 4, False, False), (128, 128, 128, 8, False, False), (128, 128, 128, 8, True, False),
     (128, 128, 128, 8, True, True)],
)
def test_mxfp8_decode_kernel_reads_16_byte_words_and_decodes_them_with_integer_instructions_on_sm90(
    block_m, block_n, block_k, warps, a_first, one_dot
):
    """Compiled for Hopper (on any machine), at each row tiling, the decode GEMM's MXFP8 program
    copies the weight's codes 16 bytes at a time, asynchronously, decodes them to bf16 with byte
    permutes and bf16x2 multiplies (fmas adding -0), no FP8 conversion instruction (a slow
    unit's), straight into the tensor cores' operand layout, and spills nothing. With A decoded first (a_first), A's
    values are copied 16 bytes at a time too, and nothing decoded goes through shared memory
    but (one_dot) the weight's tile on its way into the operand layout, whose products then run
    without waiting for each other (a wgmma wait for all only once a step)."""
    pytest.importorskip("triton")
    from graphquant.kernels import triton_decode

    pointers = {**_MXFP8_POINTERS, "a_ptr": "*bf16"} if a_first else _MXFP8_POINTERS
    runtime = {**_MXFP8_RUNTIME, "M": block_m, "a_stride": 4096} if a_first else {**_MXFP8_RUNTIME, "M": block_m}
    compiled = _decode_kernel_compiled(
        pointers, runtime, warps, OPERAND=triton_decode.BF16_VALUES, SCALE_COLS=32, A_DIVISOR=1.0, B_DIVISOR=1.0, A_FACTOR=0,
        B_FACTOR=0, SPLIT=False, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, A_VALUES=a_first, ONE_DOT=one_dot,
    )
    ptx, ttgir = compiled.asm["ptx"], compiled.asm["ttgir"]
    copies = re.findall(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], (0x\w+)", ptx)
    assert "0x10" in copies and (not a_first or set(copies) == {"0x10"})
    assert "prmt.b32" in ptx and "fma.rn.bf16x2" in ptx and "wgmma" in ptx
    assert not re.search(r"cvt\.\w+\.\w+\.e4m3x2|cvt\.\w+\.e4m3", ptx)
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)
    if one_dot:
        assert "stmatrix" in ptx and waits.count("0") == 1 and len(waits) > 1
    elif a_first:
        assert not re.search(r"local_alloc %\S+ : \(tensor<", ttgir)
    else:
        _assert_only_a_through_shared_memory(ttgir, "bf16", block_m, block_n)
    assert "0 bytes spill stores" in ptxas.report(ptx)


@pytest.fixture
def hopper(monkeypatch):
    """backends.select on a CUDA device of capability 9.0 (faked) without graphquant's mixed-input
    GEMM (which takes MXFP8 and NVFP4 middle rows where it is built: tests/test_mixed_input_plan.py), what
    it worked out forgotten around."""
    if not backends.DECODE_GEMMS:
        pytest.skip("no Triton: no decode GEMM")
    monkeypatch.setattr(backends, "capability", lambda device: (9, 0))
    monkeypatch.setattr(backends.mixed_input, "extension_runs", lambda device: False)
    backends.clear_caches()
    yield backends.triton_decode
    backends.clear_caches()


@pytest.mark.parametrize("name", PAIRS)
def test_planner_picks_the_decode_gemm_for_a_static_m_up_to_its_rows(hopper, name):
    """With or without the recipe's fast accumulation: the decode GEMM always promotes its sums
    into fp32. Its rows: one tile of 16 for FP8 codes (cuBLASLt's FP8 GEMM reads the weight as fast
    past it), VALUE_ROWS for MXFP8 and NVFP4 (decoded a weight tile at a time in registers, ahead
    of the emulation's whole weight dequantized into memory on every call). A row count unknown to
    the plan (symbolic sizes) or above those, or a batch of products, goes elsewhere."""
    qa, qb = PAIRS[name]
    cuda = torch.device("cuda")
    most = _max_rows(name)
    assert most == (hopper.VALUE_ROWS if name in MIDDLE_ROW_PAIRS else 16)
    decode = backends.Selection(backends.NATIVE, GemmBackend(hopper.BACKEND))
    for m in sorted({1, 2, 16, min(128, most), min(2048, most), most}):
        for fast in (False, True):
            assert backends.select(qa, ROWWISE, qb, ROWWISE, cuda, (m, 4096, 4096), 1, fast) == decode
    for dims in ((most + 1, 4096, 4096), (None, 4096, 4096), None):
        assert backends.select(qa, ROWWISE, qb, ROWWISE, cuda, dims).backend.name != hopper.BACKEND
    assert backends.select(qa, ROWWISE, qb, ROWWISE, cuda, (2, 4096, 4096), batch=2).backend.name != hopper.BACKEND


def test_planner_keeps_e5m2_mxfp8_off_the_decode_gemm(hopper):
    """MXFP8's codes are decoded as E4M3 words: an E5M2 MXFP8 operand (a HYBRID recipe's gradient
    in a dgrad of few rows) goes elsewhere, where it once was read as E4M3 and silently wrong."""
    cuda = torch.device("cuda")
    for qa, qb in ((MXFP8Quantizer("e5m2"), MXFP8Quantizer()), (MXFP8Quantizer(), MXFP8Quantizer("e5m2"))):
        chosen = backends.select(qa, ROWWISE, qb, ROWWISE, cuda, (16, 4096, 4096))
        assert chosen.backend.name not in (hopper.BACKEND, hopper.QUANTIZING_BACKEND), chosen
    chosen = backends.select(MXFP8Quantizer(), ROWWISE, MXFP8Quantizer(), ROWWISE, cuda, (16, 4096, 4096))
    assert chosen.backend.name == hopper.BACKEND, chosen


@pytest.mark.parametrize("recipe", ["mxfp8_block_scaling", "nvfp4_block_scaling"])
def test_a_frozen_model_plans_the_decode_gemm_at_middle_rows(hopper, monkeypatch, recipe):
    """A frozen model (mode="inference", then graphquant.freeze) on a faked Hopper, at 16, 64 and
    128 rows (a static graph each): every linear's fprop planned on the decode GEMM, the plan's
    dump names it on each, and the calls reach it with the rows they have (the decode GEMM stood
    in for by the emulated GEMM on this CPU); at 2048 rows the emulation, and the dump says why."""
    import graphquant
    from graphquant import recipes
    from reference import emulated_stand_in

    rows = []
    monkeypatch.setattr(hopper, "gemm", emulated_stand_in(rows))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256, bias=False), torch.nn.GELU(), torch.nn.Linear(256, 128, bias=False))
    compiled = graphquant.compile(model.to(torch.bfloat16), getattr(recipes, recipe)(), mode="inference", backend="aot_eager", dynamic=False)
    graphquant.freeze(compiled)
    with torch.no_grad():
        for m in (16, 64, 128, 2048):
            compiled(torch.randn(m, 128, dtype=torch.bfloat16))
    plans = compiled.graphquant.plans
    assert len(plans) == 4
    for plan in plans[:3]:
        fprops = [g for g in plan.gemms if g.gemm == "fprop"]
        assert len(fprops) == 2 and all(g.backend == GemmBackend(hopper.BACKEND) for g in fprops), str(plan)
        assert sum(line.split()[2] == "fprop" and hopper.BACKEND in line for line in str(plan).splitlines()[3:]) == 2, str(plan)
    assert {g.backend.name for g in plans[3].gemms if g.gemm == "fprop"} == {backends.EMULATION}, str(plans[3])
    assert f"multiplies at most {hopper.VALUE_ROWS} rows of A" in str(plans[3])
    assert rows == [16, 16, 64, 64, 128, 128]


def test_planner_keeps_operands_stored_k_first_off_the_decode_gemm(hopper):
    """MXFP8's columnwise data keeps x's layout (reduction dim first): a dgrad of it is emulated."""
    selection = backends.select(MXFP8Quantizer(), ROWWISE, MXFP8Quantizer(), COLUMNWISE, torch.device("cuda"), (1, 256, 256))
    assert selection.backend == GemmBackend(backends.EMULATION)
    assert selection.reason == "triton decode gemm reads operands stored with the reduction dim last"


def test_a_decode_tiling_names_what_is_wrong_with_it():
    pytest.importorskip("triton")
    from graphquant.kernels.triton_decode import DecodeConfig

    with pytest.raises(ValueError, match=r"block_n=48 is not a power of two; block_k=1024 is not from 32 to 512"):
        DecodeConfig(block_n=48, block_k=1024)
    with pytest.raises(ValueError, match=r"mx_products='sums' is not one of \('values', 'block sums', 'dot scaled'\)"):
        DecodeConfig(mx_products="sums")
    with pytest.raises(ValueError, match=r"the FMA units multiply one row of A a program \(block_m=8\)"):
        DecodeConfig(block_m=8, fma=True)
    with pytest.raises(ValueError, match=r"the tensor cores multiply tiles of at least 16 rows \(block_n=64, block_m=4\)"):
        DecodeConfig(block_m=4)
    with pytest.raises(ValueError, match=r"one_dot multiplies A decoded first \(a_first\)"):
        DecodeConfig(one_dot=True)
    with pytest.raises(ValueError, match=r"A is decoded first for the tensor cores' products of values alone"):
        DecodeConfig(mx_products="block sums", a_first=True)


def test_decode_gemm_names_what_it_cannot_take():
    pytest.importorskip("triton")
    from graphquant.kernels import triton_decode

    rowwise = Float8RowwiseQuantizer()
    a = rowwise(torch.randn(17, 128), columnwise=False).get(ROWWISE)
    b = rowwise(torch.randn(64, 128), columnwise=False).get(ROWWISE)
    with pytest.raises(ValueError, match=r"at most 16 rows of A for fp8_rowwise x fp8_rowwise; got A of 17 rows"):
        triton_decode.gemm(a, b, torch.bfloat16)
    one_row = rowwise(torch.randn(1, 128), columnwise=False).get(ROWWISE)
    with pytest.raises(ValueError, match=r"multiplies FP8 codes on the tensor cores only"):
        triton_decode.gemm(one_row, b, torch.bfloat16, None, triton_decode.DecodeConfig(block_m=1, fma=True))
    with pytest.raises(ValueError, match=r"multiplies FP8 codes on the tensor cores only, as they load"):
        triton_decode.gemm(one_row, b, torch.bfloat16, None, triton_decode.DecodeConfig(a_first=True))
    mx_a = MXFP8Quantizer()(torch.randn(2, 128), columnwise=False).get(ROWWISE)
    mx_b = MXFP8Quantizer()(torch.randn(64, 128), columnwise=False).get(ROWWISE)
    with pytest.raises(ValueError, match=r"mxfp8 pair operands take block_k >= 64 \(each of a step's dots at least 16 deep\)"):
        triton_decode.gemm(mx_a, mx_b, torch.bfloat16, None, triton_decode.DecodeConfig(block_k=32))
    mx = MXFP8Quantizer()
    a = mx(torch.randn(1, 128), columnwise=False).get(ROWWISE)
    b = mx(torch.randn(128, 64)).get(COLUMNWISE)
    with pytest.raises(ValueError, match=r"reduction dim last; B is mxfp8\(fp8_dtype=e4m3\) \(columnwise\), stored with it first"):
        triton_decode.gemm(a, b, torch.bfloat16)


if __name__ == "__main__":  # the interpreted cases, as the fixture ``interpreted`` runs them
    triton_interpreter.accept_numpy_scalars()
    results = {
        f"{name} | {_interpreted_id(case)}": excess(name, *case[:-1], "cpu", case[-1]) for name, case in _interpreted_cases()
    }
    for name, config, case in _config_cases():
        key = f"{name} | {config} | {_interpreted_id(case).split()[1]}"
        results[key] = excess(name, *case[:-1], "cpu", case[-1], _configs()[name][config])
    print(json.dumps(results))
