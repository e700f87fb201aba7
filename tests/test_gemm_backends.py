"""GEMM backends: each backend's product equals the float64 product of the dequantized operands.

The GPU cases run every native cuBLASLt path and the emulated path in fprop, dgrad and wgrad
layouts; the CPU cases pin the block-scale swizzle of the sm100 paths and the planner's choices.
"""

import pathlib
import re

import pytest
import torch

from graphquant.formats import fp8
from graphquant.kernels import backends, block_scaled, devices, emulation, scaled_mm
from graphquant.quantizers import (
    COLUMNWISE,
    ROWWISE,
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8RowwiseQuantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    QuantizeContext,
)

# (name, quantizer of A's direction, quantizer of B's direction, expected backend on sm90)
PAIRS = [
    ("tensorwise e4m3", Float8CurrentScalingQuantizer("e4m3"), Float8CurrentScalingQuantizer("e4m3"), scaled_mm.TENSORWISE),
    ("tensorwise e5m2 x e4m3", Float8CurrentScalingQuantizer("e5m2"), Float8CurrentScalingQuantizer("e4m3"), scaled_mm.TENSORWISE),
    ("rowwise", Float8RowwiseQuantizer(), Float8RowwiseQuantizer(), scaled_mm.ROWWISE_SCALED),
    ("block 1x128 x 128x128", Float8BlockQuantizer(block_scaling_dim=1), Float8BlockQuantizer(block_scaling_dim=2), scaled_mm.BLOCKWISE),
    ("block 1x128 x 1x128", Float8BlockQuantizer(block_scaling_dim=1), Float8BlockQuantizer(block_scaling_dim=1), scaled_mm.BLOCKWISE),
    ("mxfp8", MXFP8Quantizer(), MXFP8Quantizer(), backends.EMULATION),
    ("nvfp4", NVFP4Quantizer(), NVFP4Quantizer(with_2d_quantization=True), backends.EMULATION),
    ("mxfp8 x nvfp4", MXFP8Quantizer(), NVFP4Quantizer(), backends.EMULATION),
    ("identity x mxfp8", IdentityQuantizer(), MXFP8Quantizer(), backends.EMULATION),
    ("identity", IdentityQuantizer(), IdentityQuantizer(), backends.HIGH_PRECISION),
]

# More rows than the decode GEMM takes for any pair (triton_decode.MAX_ROWS; tests/test_triton_decode.py
# checks its choices), so that these tests see the other backends.
PAST_DECODE_ROWS = 16384 + 128

# (GEMM, direction of A, direction of B): A and B reduce over the dim their direction blocks.
LAYOUTS = [("fprop", ROWWISE, ROWWISE), ("dgrad", ROWWISE, COLUMNWISE), ("wgrad", COLUMNWISE, COLUMNWISE)]


def _operand(quantizer, direction, rows, k, device, amplitude=4.0):
    """A representation whose GEMM operand is (rows, k): columnwise ones come from a (k, rows)
    source, of values up to about ``amplitude``."""
    source = torch.randn(rows, k) if direction == ROWWISE else torch.randn(k, rows)
    source = (source * torch.rand(source.shape[0], 1) * amplitude).to(torch.bfloat16).to(device)
    qt = quantizer(source, rowwise=direction == ROWWISE, columnwise=direction == COLUMNWISE, ctx=QuantizeContext())
    return qt.get(direction)


def _on_this_machine(expected, qb, m, n, k):
    """``expected``, or graphquant's block-scaled GEMM where it runs the pair instead: B in 128x128
    tiles, a k of whole 16 bytes that cuBLASLt would pad (no multiple of scaled_mm.TILE_SCALED_K) or
    an output of few tiles (it splits K), and the extension built for an sm_90 GPU (the GPU machine)."""
    cuda = torch.device("cuda")
    if not (expected == scaled_mm.BLOCKWISE and qb.block_scaling_dim == 2 and block_scaled.extension_runs(cuda)):
        return expected
    its_shape = k % scaled_mm.TILE_SCALED_K != 0 or block_scaled.splits_k(m, n, k, cuda)
    return block_scaled.BACKEND if its_shape and k % block_scaled.K_MULTIPLE == 0 else expected


def _reference(a, b):
    return a.gemm_operand(torch.float64) @ b.gemm_operand(torch.float64).t()


def _bound(a, b, promote_every):
    """How far a GEMM of representations a and b summing as ``promote_every`` says
    (fp8.accumulation_bound) may lie from ``_reference``, before any rounding of its output: its
    sums' error and one rounding for each factor it applies (scales, the product of two)."""
    left, right = a.gemm_operand(torch.float64), b.gemm_operand(torch.float64).t()
    return fp8.accumulation_bound(left, right, promote_every) + 3 * 2.0**-24 * (left.abs() @ right.abs())


def _promote_every(selection: backends.Selection):
    """How the selected GEMM sums (fp8.accumulation_bound's promote_every): on Hopper's FP8 tensor
    cores, promoted every 128 products or, accumulating fast, never; any other product in fp32."""
    if selection.bucket != backends.NATIVE:
        return fp8.FP32
    return fp8.FAST if selection.backend.fast_accumulation else fp8.PROMOTED_PRODUCTS


# (m, k) of each pair: multiples of every block; m that is not (17 past them); a k of whole 128-blocks
# that is no multiple of 512 (cuBLASLt's 128x128 scaling misreads its scales there:
# scaled_mm.TILE_SCALED_K); and, for the FP8 formats and high precision, whose quantizers take any
# k, a k that is not (MXFP8 and NVFP4 refuse it).
SIZES = [
    pytest.param(*pair, m, n, k, id=f"{pair[0]}-{size}")
    for pair in PAIRS
    for m, n, k, size in [
        (PAST_DECODE_ROWS, 384, 512, "aligned"),
        (PAST_DECODE_ROWS + 17, 384, 512, "m-odd"),
        (PAST_DECODE_ROWS, 384, 640, "k-blocks"),
        (PAST_DECODE_ROWS, 384, 500, "k-odd"),
        (PAST_DECODE_ROWS, 200, 512, "n-odd"),
    ]
    if (k % 32 == 0 and n % 32 == 0) or pair[3] in (*scaled_mm.FP8_MULTIPLES, backends.HIGH_PRECISION)
]


@pytest.mark.gpu
@pytest.mark.parametrize("fast_accumulation", [False, True], ids=["promoted", "fast"])
@pytest.mark.parametrize("gemm,da,db", LAYOUTS, ids=[g for g, _, _ in LAYOUTS])
@pytest.mark.parametrize("name,qa,qb,expected,m,n,k", SIZES)
def test_backend_matches_float64_reference(name, qa, qb, expected, m, n, k, gemm, da, db, fast_accumulation):
    """Every backend, at m, n and k multiples of every block and at an m, an n or a k that is not
    (the cuBLASLt GEMMs pad them: scaled_mm.block_scaled_rows, whole_reduction, whole_rows, and
    128x128 scaling's k to a multiple of TILE_SCALED_K)."""
    _check_on_the_gpu(name, qa, qb, expected, m, n, k, gemm, da, db, fast_accumulation)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [256, 384, 1408, 2816, 11008])
@pytest.mark.parametrize("m", [64, 4096])
def test_blockwise_gemm_matches_float64_reference_at_real_layers_k(m, k):
    """At the k of real layers whose 128-blocks are no multiple of 4 (an MoE expert's 1408 and
    2816, Llama-2's 11008), at few rows and many: before scaled_mm.TILE_SCALED_K cuBLASLt's 128x128
    scaling misread its scales there, by relative errors of 0.01 to 80 as the kernel it picked."""
    name, qa, qb, expected = next(pair for pair in PAIRS if pair[0] == "block 1x128 x 128x128")
    for gemm, da, db in LAYOUTS[:2]:  # fprop and dgrad read the weight's 128x128 tiles
        _check_on_the_gpu(name, qa, qb, expected, m, 512, k, gemm, da, db, False)


def test_the_plan_s_split_rule_is_the_kernel_s():
    """block_scaled.splits_k predicts block_gemm.cu's own choice, which the plan relies on: the
    kernel's fewest K blocks a split and its tile are the module's constants."""
    source = (pathlib.Path(__file__).parents[1] / "csrc/cuda/block_gemm.cu").read_text()
    assert re.search(r"k_split\(splits, [^;]*, blocks, sms, (\d+)\)", source).group(1) == str(block_scaled.LEAST_SPLIT_BLOCKS)
    assert re.search(r"constexpr int TILE = (\d+);", source).group(1) == str(block_scaled.TILE)


@pytest.mark.parametrize(
    "a_element,m,n,k,expected",
    [
        ("e4m3", PAST_DECODE_ROWS, 4096, 640, block_scaled.BACKEND),  # k / 128 = 5: cuBLASLt would pad k to 1024 each call
        ("e4m3", PAST_DECODE_ROWS, 4096, 11008, block_scaled.BACKEND),
        ("e4m3", PAST_DECODE_ROWS, 4096, 1024, scaled_mm.BLOCKWISE),  # a multiple of TILE_SCALED_K: cuBLASLt's, faster there
        ("e4m3", PAST_DECODE_ROWS, 4096, 1000, scaled_mm.BLOCKWISE),  # not whole 16 bytes a row: TMA cannot read it, cuBLASLt pads it
        ("e5m2", PAST_DECODE_ROWS, 4096, 640, block_scaled.BACKEND),  # E5M2 gradients, which cuBLASLt's blockwise GEMM does not take,
        ("e5m2", PAST_DECODE_ROWS, 4096, 1024, block_scaled.BACKEND),  # at any k
        ("e4m3", 64, 4096, 14336, block_scaled.BACKEND),  # 32 output tiles: K split fills the SMs cuBLASLt's leaves idle
        ("e4m3", 256, 4096, 14336, block_scaled.BACKEND),  # 64 tiles, at most half of 132 SMs
        ("e4m3", 257, 4096, 14336, scaled_mm.BLOCKWISE),  # 96 tiles
        ("e4m3", 64, 14336, 4096, scaled_mm.BLOCKWISE),  # 112 tiles
        ("e4m3", 64, 4096, 512, scaled_mm.BLOCKWISE),  # 32 tiles, but 4 K blocks: one split, as the kernel takes them
    ],
)
def test_block_scaled_gemm_runs_the_k_cublaslt_would_pad(a_element, m, n, k, expected, monkeypatch):
    """On Hopper with graphquant's extension, 1x128 x 128x128 GEMMs whose k cuBLASLt takes only padded,
    or whose elements it does not take, or whose output is few enough tiles that graphquant's kernel
    splits K, run on graphquant's block-scaled GEMM; the others stay on cuBLASLt's."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(devices, "multiprocessors", lambda device: 132)  # an H100's or H200's
    extension = type("Extension", (), {"block_gemm": None, "cuda_archs": (90,)})
    monkeypatch.setattr(block_scaled, "native", type("Native", (), {"extension_for": staticmethod(lambda device: extension)}))
    backends.clear_caches()
    try:
        qa, qb = Float8BlockQuantizer(a_element, 1), Float8BlockQuantizer(block_scaling_dim=2)
        selected = backends.select(qa, ROWWISE, qb, ROWWISE, torch.device("cuda"), (m, n, k))
        assert selected.backend.name == expected, selected
    finally:
        backends.clear_caches()


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("a_element", ["e4m3", "e5m2"])
@pytest.mark.parametrize("m,n,k", [(1, 256, 512), (17, 200, 112), (130, 201, 1408), (4113, 1000, 640)])
def test_block_scaled_gemm_takes_any_m_and_n_and_k_of_whole_16_bytes(m, n, k, a_element, out_dtype):
    """graphquant's block-scaled GEMM at one row, rows and columns past whole tiles (an odd n), a k
    of a partial 128-block, more output tiles than SMs (each CTA then takes several), E5M2
    gradients, each output dtype, with and without a bias: within the bound of the float64 product
    and the output's one rounding."""
    if not block_scaled.extension_runs(torch.device("cuda")):
        pytest.skip("graphquant's extension is not built for this GPU")
    torch.manual_seed(0)
    a = _operand(Float8BlockQuantizer(a_element, 1), ROWWISE, m, k, "cuda")
    b = _operand(Float8BlockQuantizer(block_scaling_dim=2), ROWWISE, n, k, "cuda")
    rounding = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[out_dtype]
    for bias in (None, (torch.randn(n, device="cuda") * 64).to(torch.bfloat16)):
        out = block_scaled.gemm(a, b, out_dtype, bias)
        assert out.shape == (m, n) and out.dtype == out_dtype
        ref = _reference(a, b) + (0 if bias is None else bias.double())
        bound = _bound(a, b, fp8.PROMOTED_PRODUCTS) + ref.abs() * rounding
        excess = ((out.double() - ref).abs() - bound).max().item()
        assert excess <= 0, f"{m}x{n}x{k} {a_element} -> {out_dtype}, bias {bias is not None}: error exceeds the bound by {excess}"


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("m,n,k", [(1, 256, 16384), (64, 4096, 11008), (130, 201, 1408), (300, 384, 2816)])
def test_block_scaled_gemm_splits_k_within_the_bound_and_the_same_bits_every_call(m, n, k, out_dtype):
    """Where the output's tiles fill few SMs the kernel splits K (one row: up to a split an SM; a
    few rows of a down projection's 86 blocks; 11 blocks in 2; the kernel's choice, 0, beside 1, 3
    and 7 splits, the last not dividing the blocks evenly): each within the bound of the float64
    product with the bias and the output's one rounding, and each the same bits at every call (the
    splits' sums added in split order)."""
    if not block_scaled.extension_runs(torch.device("cuda")):
        pytest.skip("graphquant's extension is not built for this GPU")
    torch.manual_seed(0)
    a = _operand(Float8BlockQuantizer("e4m3", 1), ROWWISE, m, k, "cuda")
    b = _operand(Float8BlockQuantizer(block_scaling_dim=2), ROWWISE, n, k, "cuda")
    bias = (torch.randn(n, device="cuda") * 64).to(torch.bfloat16)
    rounding = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}[out_dtype]
    ref = _reference(a, b) + bias.double()
    bound = _bound(a, b, fp8.PROMOTED_PRODUCTS) + ref.abs() * rounding
    for splits in (0, 1, 3, 7):
        out = block_scaled.gemm(a, b, out_dtype, bias, splits=splits)
        excess = ((out.double() - ref).abs() - bound).max().item()
        assert excess <= 0, f"{m}x{n}x{k} -> {out_dtype}, {splits} splits: error exceeds the bound by {excess}"
        assert torch.equal(block_scaled.gemm(a, b, out_dtype, bias, splits=splits), out), f"{m}x{n}x{k}, {splits} splits: other bits"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="one GPU")
def test_block_scaled_gemm_runs_on_each_device_of_the_process():
    """Each device holds its own copy of the kernel, so its shared memory is opted into and its
    resident clusters counted on each (hopper.cuh's opt_in_shared_memory), not on the first device
    the process used alone: the same product, bit for bit, on the second device and back on the
    first."""
    if not block_scaled.extension_runs(torch.device("cuda:0")):
        pytest.skip("graphquant's extension is not built for this GPU")
    outs = []
    for device in ("cuda:0", "cuda:1", "cuda:0"):
        torch.manual_seed(0)
        a = _operand(Float8BlockQuantizer(block_scaling_dim=1), ROWWISE, 300, 640, device)
        b = _operand(Float8BlockQuantizer(block_scaling_dim=2), ROWWISE, 384, 640, device)
        outs.append(block_scaled.gemm(a, b, torch.float32))
        assert outs[-1].device == torch.device(device)
    assert all(torch.equal(out.cpu(), outs[0].cpu()) for out in outs)


def _check_on_the_gpu(name, qa, qb, expected, m, n, k, gemm, da, db, fast_accumulation):
    """The selected backend is ``expected`` (or _on_this_machine's) and its out (m, n) lies within
    _bound of _reference."""
    torch.manual_seed(0)
    expected = _on_this_machine(expected, qb, m, n, k)
    a, b = _operand(qa, da, m, k, "cuda"), _operand(qb, db, n, k, "cuda")
    selection = backends.select(qa, da, qb, db, torch.device("cuda"), (m, n, k), 1, fast_accumulation)
    fast = selection.backend.fast_accumulation
    assert selection.backend.name == expected
    assert fast == (fast_accumulation and expected in (scaled_mm.TENSORWISE, scaled_mm.ROWWISE_SCALED))
    out = backends.gemm(a, b, 1, torch.float32, selection.backend, f"{name} {gemm}")[0].double()
    ref = _reference(a, b)
    # The rowwise path returns bf16 (2^-9 relative rounding of the result).
    bound = _bound(a, b, _promote_every(selection))
    if expected == scaled_mm.ROWWISE_SCALED:
        bound = bound + ref.abs() * 2.0**-8
    excess = ((out - ref).abs() - bound).max().item()
    assert excess <= 0, f"{name} {gemm}: error exceeds the bound by {excess}"


def test_swizzled_block_scales_places_each_scale_in_its_tile():
    rows, cols = 200, 6  # partial tiles in both dims
    scale = torch.arange(rows * cols, dtype=torch.int32).reshape(rows, cols)
    flat = scaled_mm.swizzled_block_scales(scale)
    assert flat.numel() == 256 * 8
    for r, c in [(0, 0), (31, 3), (32, 0), (127, 3), (128, 4), (199, 5), (77, 2)]:
        tile = (r // 128) * (8 // 4) + c // 4
        offset = tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
        assert flat[offset] == scale[r, c]
    assert torch.equal(flat.sort().values[-rows * cols :], scale.flatten().sort().values)


@pytest.mark.parametrize("direction", [ROWWISE, COLUMNWISE])
def test_1x128_scales_need_no_relayout_for_the_blockwise_gemm(direction):
    """1x128 scales are made outer-dim-major, so the GEMM call passes them as they are."""
    a = _operand(Float8BlockQuantizer(block_scaling_dim=1), direction, 256, 384, "cpu")
    b = _operand(Float8BlockQuantizer(block_scaling_dim=1), direction, 128, 384, "cpu")
    args, _ = scaled_mm.arguments(scaled_mm.BLOCKWISE, a, b, torch.bfloat16)
    assert args[2].data_ptr() == a.scale.data_ptr() and args[2].stride() == (1, 256)
    assert args[3].data_ptr() == b.scale.data_ptr() and args[3].stride() == (128, 1)


@pytest.mark.parametrize("fast_accumulation", [False, True])
def test_fast_accumulation_is_the_callers_choice_for_per_tensor_and_per_row_fp8(monkeypatch, fast_accumulation):
    """On a Hopper (capability faked), any GEMM direction takes fast accumulation exactly when asked,
    except FP8 block GEMMs, which cuBLAS always promotes (at more rows than the decode GEMM takes)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    backends.select.cache_clear()
    try:
        for _, qa, qb, expected in PAIRS:
            for _, da, db in LAYOUTS:
                backend = backends.select(qa, da, qb, db, torch.device("cuda"), (PAST_DECODE_ROWS, 384, 512), 1, fast_accumulation).backend
                may = expected in (scaled_mm.TENSORWISE, scaled_mm.ROWWISE_SCALED)
                assert backend == backends.GemmBackend(expected, fast_accumulation and may)
    finally:
        backends.select.cache_clear()


def test_planner_choices_on_cpu_are_emulated_except_high_precision():
    cpu = torch.device("cpu")
    assert backends.select(IdentityQuantizer(), ROWWISE, IdentityQuantizer(), ROWWISE, cpu).bucket == backends.NATIVE
    selection = backends.select(MXFP8Quantizer(), ROWWISE, MXFP8Quantizer(), ROWWISE, cpu)
    assert (selection.bucket, selection.reason) == (backends.EMULATED, "no low-precision GEMM on cpu")
    rht = NVFP4Quantizer(with_rht=True, with_post_rht_amax=True)
    assert backends.select(rht, COLUMNWISE, NVFP4Quantizer(), COLUMNWISE, cpu).bucket == backends.REJECTED


# (capability, A's quantizer and direction, B's, the backend chosen): the element and layout rules
# of each native GEMM, on the capabilities that have it and on one that does not, at more rows
# than the decode GEMM takes (tests/test_triton_decode.py checks its rules).
CAPABILITY_CASES = [
    ((9, 0), Float8CurrentScalingQuantizer("e5m2"), ROWWISE, Float8CurrentScalingQuantizer("e5m2"), ROWWISE, backends.EMULATION),
    ((8, 9), Float8CurrentScalingQuantizer("e4m3"), ROWWISE, Float8CurrentScalingQuantizer("e4m3"), ROWWISE, backends.EMULATION),
    ((10, 0), Float8CurrentScalingQuantizer("e4m3"), ROWWISE, Float8CurrentScalingQuantizer("e5m2"), COLUMNWISE, scaled_mm.TENSORWISE),
    ((9, 0), Float8RowwiseQuantizer("e4m3"), ROWWISE, Float8RowwiseQuantizer("e5m2"), ROWWISE, backends.EMULATION),
    ((12, 0), Float8RowwiseQuantizer("e4m3"), COLUMNWISE, Float8RowwiseQuantizer("e4m3"), COLUMNWISE, scaled_mm.ROWWISE_SCALED),
    ((9, 0), Float8BlockQuantizer(block_scaling_dim=2), ROWWISE, Float8BlockQuantizer(block_scaling_dim=1), ROWWISE, backends.EMULATION),
    ((9, 0), Float8BlockQuantizer("e5m2", 1), ROWWISE, Float8BlockQuantizer(block_scaling_dim=1), ROWWISE, backends.EMULATION),
    ((10, 0), Float8BlockQuantizer(block_scaling_dim=1), ROWWISE, Float8BlockQuantizer(block_scaling_dim=2), ROWWISE, backends.EMULATION),
    ((10, 0), MXFP8Quantizer(), ROWWISE, MXFP8Quantizer(), COLUMNWISE, scaled_mm.MXFP8),
    ((10, 0), MXFP8Quantizer("e5m2"), ROWWISE, MXFP8Quantizer(), ROWWISE, backends.EMULATION),
    ((10, 0), NVFP4Quantizer(), ROWWISE, NVFP4Quantizer(with_2d_quantization=True), COLUMNWISE, scaled_mm.NVFP4),
    ((10, 0), NVFP4Quantizer(row_scaled_nvfp4=True), ROWWISE, NVFP4Quantizer(), ROWWISE, backends.EMULATION),
    ((10, 0), NVFP4Quantizer(row_scaled_nvfp4=True), COLUMNWISE, NVFP4Quantizer(), COLUMNWISE, scaled_mm.NVFP4),
    ((10, 0), MXFP8Quantizer(), ROWWISE, NVFP4Quantizer(), ROWWISE, backends.EMULATION),
    ((10, 0), IdentityQuantizer(), ROWWISE, IdentityQuantizer(torch.float32), ROWWISE, backends.HIGH_PRECISION),
]


@pytest.mark.parametrize("capability,qa,da,qb,db,expected", CAPABILITY_CASES)
def test_each_native_gemm_takes_its_families_elements_and_capabilities(capability, qa, da, qb, db, expected, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    backends.select.cache_clear()
    try:
        assert backends.select(qa, da, qb, db, torch.device("cuda"), (PAST_DECODE_ROWS, 384, 512)).backend.name == expected
    finally:
        backends.select.cache_clear()


def test_an_emulated_pair_of_one_format_names_the_fields_no_native_gemm_takes(monkeypatch):
    """NVFP4 x NVFP4 is native on sm_100, row-scaled NVFP4 rowwise is not: the reason says which.
    Where Triton is installed (torch's CUDA wheels bring it) the decode GEMM takes the pair at decode
    rows, and past them the reason is its row limit; without it, the fields'."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))

    def reason() -> str:
        backends.select.cache_clear()
        try:
            pair = (NVFP4Quantizer(row_scaled_nvfp4=True), ROWWISE, NVFP4Quantizer(), ROWWISE)
            return backends.select(*pair, torch.device("cuda"), (PAST_DECODE_ROWS, 384, 512)).reason
        finally:
            backends.select.cache_clear()

    if backends.DECODE_GEMMS:
        assert f"at most 128 rows of A for nvfp4_row_scaled x nvfp4, a number known when the plan is made; got m = {PAST_DECODE_ROWS}" in reason()
        monkeypatch.setattr(backends, "NATIVE_GEMMS", tuple(g for g in backends.NATIVE_GEMMS if g not in backends.DECODE_GEMMS))
    assert reason() == "no native nvfp4(row_scaled_nvfp4=True) x nvfp4() GEMM on sm_100"


@pytest.mark.gpu
@pytest.mark.parametrize("fast_accumulation", [False, True], ids=["promoted", "fast"])
@pytest.mark.parametrize("m", [17, 200])
def test_per_row_gemm_of_few_output_tiles_matches_float64_reference(m, fast_accumulation):
    """Per row, few rows of a long K (their scales applied after a product per tensor, which
    splits K: scaled_mm.per_row_scaled_after), with and without a bias: the float64 product
    within the bound."""
    torch.manual_seed(0)
    n, k = 512, 4096
    a, b = _operand(Float8RowwiseQuantizer(), ROWWISE, m, k, "cuda"), _operand(Float8RowwiseQuantizer(), ROWWISE, n, k, "cuda")
    assert scaled_mm.per_row_scaled_after(m, n, torch.device("cuda"))
    backend = backends.GemmBackend(scaled_mm.ROWWISE_SCALED, fast_accumulation)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    ref = _reference(a, b)
    bound = _bound(a, b, fp8.FAST if fast_accumulation else fp8.PROMOTED_PRODUCTS)
    for with_bias in (None, bias):
        out = backends.gemm(a, b, 1, torch.bfloat16, backend, "per row", with_bias)[0].double()
        expected = ref + (0 if with_bias is None else with_bias.double())
        assert ((out - expected).abs() - bound - expected.abs() * 2.0**-8).max().item() <= 0  # and bf16's rounding


@pytest.mark.parametrize("name,qa,qb,expected", PAIRS[:5], ids=[p[0] for p in PAIRS[:5]])
def test_cublaslt_fp8_gemms_take_any_shape(name, qa, qb, expected, monkeypatch):
    """A call of 17 or 100 rows, a reduction over 1000 tokens, or an LM head of 32001 rows runs on
    cuBLASLt, not on the emulation, 5-20x slower there (benchmarks/NOTES.md, decode_gemm.py)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    backends.select.cache_clear()
    try:
        for m, n, k in ((17, 384, 512), (100, 384, 512), (PAST_DECODE_ROWS + 17, 384, 512), (PAST_DECODE_ROWS, 384, 1000),
                        (100, 392, 512), (PAST_DECODE_ROWS, 32001, 4096)):
            selected = backends.select(qa, ROWWISE, qb, ROWWISE, torch.device("cuda"), (m, n, k)).backend.name
            assert selected == _on_this_machine(expected, qb, m, n, k), (m, n, k)
    finally:
        backends.select.cache_clear()


@pytest.mark.parametrize("gemm,da,db", LAYOUTS, ids=[g for g, _, _ in LAYOUTS])
def test_high_precision_gemm_takes_identity_operands_as_they_are(gemm, da, db):
    """An Identity x Identity GEMM (e.g. rowwise_with_gw_hp's wgrad) multiplies the stored tensors,
    with no fp32 (or any) copy of a token-sized operand; its values are checked with PAIRS."""
    for rep in (_operand(IdentityQuantizer(), d, rows, 96, "cpu") for d, rows in ((da, 64), (db, 48))):
        values, factor = emulation.factored(rep)
        assert values is rep.data and factor is None


@pytest.mark.parametrize("gemm,da,db", LAYOUTS, ids=[g for g, _, _ in LAYOUTS])
@pytest.mark.parametrize("name,qa,qb,expected", PAIRS, ids=[p[0] for p in PAIRS])
def test_emulation_matches_float64_reference_on_cpu(name, qa, qb, expected, gemm, da, db):
    torch.manual_seed(0)
    m, n, k = 64, 96, 128
    a, b = _operand(qa, da, m, k, "cpu"), _operand(qb, db, n, k, "cpu")
    out = emulation.gemm(a, b, 1, torch.float32)[0].double()
    assert ((out - _reference(a, b)).abs() <= _bound(a, b, fp8.FP32)).all()


# Pairs whose per-tensor or per-row factors the emulated product takes out of the operands.
FACTORED = [
    ("tensorwise e4m3", Float8CurrentScalingQuantizer("e4m3"), Float8CurrentScalingQuantizer("e4m3")),
    ("rowwise", Float8RowwiseQuantizer(), Float8RowwiseQuantizer()),
    ("nvfp4", NVFP4Quantizer(), NVFP4Quantizer(with_2d_quantization=True)),
    ("nvfp4 row-scaled x nvfp4", NVFP4Quantizer(row_scaled_nvfp4=True), NVFP4Quantizer()),
]


@pytest.mark.parametrize("gemm,da,db", LAYOUTS, ids=[g for g, _, _ in LAYOUTS])
@pytest.mark.parametrize("name,qa,qb", FACTORED, ids=[p[0] for p in FACTORED])
def test_emulated_factors_meet_before_the_product_on_cpu(name, qa, qb, gemm, da, db):
    """A near 1e36 and B near 1e-3: A's factor (~1e33) times the product of A's and B's values
    overflows fp32, the product times both factors does not; the emulation multiplies the two
    factors first (as the GPU's alpha), so the result is finite and within the usual bound."""
    torch.manual_seed(0)
    m, n, k = 64, 96, 128
    a, b = _operand(qa, da, m, k, "cpu", 1e36), _operand(qb, db, n, k, "cpu", 1e-3)
    out = emulation.gemm(a, b, 1, torch.float32)[0].double()
    assert torch.isfinite(out).all()
    assert ((out - _reference(a, b)).abs() <= _bound(a, b, fp8.FP32)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("name,qa,qb,expected", PAIRS, ids=[p[0] for p in PAIRS])
def test_backend_adds_the_bias_before_rounding(name, qa, qb, expected):
    """A linear's bias goes into the GEMM (cuBLASLt's epilogue where the call allows): bf16 out of
    the fp32 product plus the bias, rounded once, within the accumulation bound of the reference."""
    torch.manual_seed(0)
    m, n, k = PAST_DECODE_ROWS, 384, 512
    a, b = _operand(qa, ROWWISE, m, k, "cuda"), _operand(qb, ROWWISE, n, k, "cuda")
    bias = (torch.randn(n, device="cuda") * 64).to(torch.bfloat16)
    selection = backends.select(qa, ROWWISE, qb, ROWWISE, torch.device("cuda"), (m, n, k))
    out = backends.gemm(a, b, 1, torch.bfloat16, selection.backend, name, bias)[0].double()
    ref = _reference(a, b) + bias.double()
    bound = _bound(a, b, _promote_every(selection)) + ref.abs() * 2.0**-8
    excess = ((out - ref).abs() - bound).max().item()
    assert excess <= 0, f"{name}: error exceeds the bound by {excess}"


@pytest.mark.parametrize("name,qa,qb,expected", PAIRS, ids=[p[0] for p in PAIRS])
def test_emulated_bias_is_added_before_the_one_rounding_on_cpu(name, qa, qb, expected):
    torch.manual_seed(0)
    a, b = _operand(qa, ROWWISE, 64, 128, "cpu"), _operand(qb, ROWWISE, 96, 128, "cpu")
    bias = torch.randn(96) * 64
    product = emulation.gemm(a, b, 1, torch.float32)
    assert torch.equal(emulation.gemm(a, b, 1, torch.bfloat16, bias), (product + bias).to(torch.bfloat16))


def test_a_bias_must_be_one_vector_over_the_outputs():
    a, b = _operand(MXFP8Quantizer(), ROWWISE, 64, 128, "cpu"), _operand(MXFP8Quantizer(), ROWWISE, 96, 128, "cpu")
    with pytest.raises(ValueError, match=r"shape \(96,\) of its output's last dim.*got a bias of shape \(64,\) for 1 group"):
        backends.gemm(a, b, 1, torch.float32, backends.GemmBackend(backends.EMULATION), "fc#0 fprop", torch.zeros(64))


@pytest.mark.parametrize("b_direction", [ROWWISE, COLUMNWISE])
def test_a_and_b_must_reduce_over_one_extent(b_direction):
    """A native kernel would read past the shorter operand: the call names both before any runs."""
    a = _operand(Float8CurrentScalingQuantizer(), ROWWISE, 64, 128, "cpu")
    b = _operand(Float8CurrentScalingQuantizer(), b_direction, 96, 256, "cpu")
    b_shape = (96, 256) if b_direction == ROWWISE else (256, 96)
    with pytest.raises(ValueError, match=rf"fc#0 fprop: .*A rowwise of shape \(64, 128\) .* over 128, B {b_direction} of shape {re.escape(str(b_shape))} .* over 256"):
        backends.gemm(a, b, 1, torch.float32, backends.GemmBackend(backends.EMULATION), "fc#0 fprop")


SLICED = [p for p in PAIRS if isinstance(p[1], (MXFP8Quantizer, NVFP4Quantizer)) or isinstance(p[2], (MXFP8Quantizer, NVFP4Quantizer))]
# A per-row factor (row-scaled NVFP4's amax per row) is cut with the slice it scales.
SLICED.append(("nvfp4 row-scaled x mxfp8", NVFP4Quantizer(row_scaled_nvfp4=True), MXFP8Quantizer(), backends.EMULATION))
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _gemm_orientation(rep):
    """rep's factored values as the emulated GEMM multiplies them (reduction dim last), and its
    factor (None, scalar or per row)."""
    values, factor = emulation._operand(rep, 1, torch.float32)
    return values[0], factor


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("direction", [ROWWISE, COLUMNWISE])
@pytest.mark.parametrize(
    "quantizer", [MXFP8Quantizer(), NVFP4Quantizer(), NVFP4Quantizer(with_2d_quantization=True), NVFP4Quantizer(row_scaled_nvfp4=True)],
    ids=["mxfp8", "nvfp4", "nvfp4 2d", "nvfp4 row-scaled"],
)
def test_rows_of_an_operand_are_its_rows(quantizer, direction, device):
    """A run of GEMM rows cut from an MXFP8 or NVFP4 operand (data, scales, per-row amax) holds
    exactly those rows of the whole operand's values and factor."""
    torch.manual_seed(0)
    rep = _operand(quantizer, direction, 320, 256, device)
    values, factor = _gemm_orientation(rep)
    for start, stop in [(0, 128), (128, 256), (256, 320), (96, 100)]:
        part, part_factor = _gemm_orientation(emulation.rows_of(rep, start, stop))
        assert torch.equal(part, values[start:stop])
        if factor is None or factor.dim() == 0:
            assert (part_factor is None) == (factor is None) and (factor is None or torch.equal(part_factor, factor))
        else:
            assert torch.equal(part_factor, factor[start:stop])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_dtype,rounding", [(torch.float32, 2.0**-24), (torch.bfloat16, 2.0**-8)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no bias", "bias"])
@pytest.mark.parametrize("gemm,da,db", LAYOUTS, ids=[g for g, _, _ in LAYOUTS])
@pytest.mark.parametrize("name,qa,qb,expected", SLICED, ids=[p[0] for p in SLICED])
def test_emulated_gemm_in_slices_of_the_larger_operand(name, qa, qb, expected, gemm, da, db, with_bias, out_dtype, rounding, device, monkeypatch):
    """Over ``slice_elements``, the larger MXFP8/NVFP4 operand is dequantized a slice of rows at a
    time: the product (and its bias) is the one of the whole operands, within fp32 accumulation."""
    torch.manual_seed(0)
    m, n, k = 384, 256, 128
    a, b = _operand(qa, da, m, k, device), _operand(qb, db, n, k, device)
    bias = (torch.randn(n) * 64).to(device, out_dtype) if with_bias else None
    cuts = []
    rows_of = emulation.rows_of
    monkeypatch.setattr(emulation, "rows_of", lambda rep, start, stop: cuts.append((rep, start, stop)) or rows_of(rep, start, stop))
    out = emulation.gemm(a, b, 1, out_dtype, bias, slice_elements=128 * k // 2)[0].double()
    big, rows = (a, m) if isinstance(qa, (MXFP8Quantizer, NVFP4Quantizer)) else (b, n)
    assert [(rep is big, start, stop) for rep, start, stop in cuts] == [(True, s, s + 128) for s in range(0, rows, 128)]
    ref = _reference(a, b) + (bias.double() if with_bias else 0)
    assert ((out - ref).abs() <= _bound(a, b, fp8.FP32) + ref.abs() * rounding).all()


def test_emulation_dequantizes_with_triton_only_where_triton_loads_e4m3(monkeypatch):
    """Triton loads E4M3 codes and scales (fp8e4nv) from sm_89 on and refuses to compile them
    below (an A100, sm_80): there the emulated MXFP8 and NVFP4 GEMMs take the reference's
    dequantize, as on the CPU, and the Triton kernel only where runs_on says so."""
    triton_dequantize = pytest.importorskip("graphquant.kernels.triton_dequantize")
    for capability, expected in (((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True)):
        devices._of.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None, capability=capability: capability)
        assert triton_dequantize.runs_on(torch.device("cuda", 0)) is expected
        assert not triton_dequantize.runs_on(torch.device("cpu"))
    rep = MXFP8Quantizer().quantize_rowwise(torch.randn(32, 64), QuantizeContext())
    monkeypatch.setitem(emulation._BLOCK_VALUES, "mxfp8", lambda rep, live: "the Triton kernel's")
    for runs, made_by_triton in ((True, True), (False, False)):
        monkeypatch.setattr(triton_dequantize, "runs_on", lambda device, runs=runs: runs)
        values = emulation.values(rep)
        assert isinstance(values, str) is made_by_triton
        if not made_by_triton:
            assert torch.equal(values, rep.quantizer.emulated_values(rep))
