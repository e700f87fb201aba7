"""Native GEMM choices on every compute capability graphquant claims, checked on the CPU.

The capability is faked (graphquant.kernels.backends.capability) and so is the GEMM call itself: a stand-in
for torch._scaled_mm and for graphquant's own fp8_gemm checks what cuBLASLt takes (operand dtypes,
the reduction dim contiguous in both operands, scale dtypes, shapes, strides and swizzled layout),
one for graphquant's block_gemm what its TMA copies and scale reads take, and each returns the
product those arguments describe, computed in float64. A small model then trains
one step under every built-in recipe: each native GEMM the plan lists must reach the stand-in with
valid arguments that describe the product of the two representations, and no other GEMM may.
The decode GEMM (Triton's, which takes MXFP8 and NVFP4 at these rows) runs the emulated product
in its place here; tests/test_triton_decode.py checks it.
"""

import collections
import math
import types

import pytest
import torch
import torch.nn.functional as F
from reference import fresh_dynamo  # noqa: F401  (an autouse fixture)
from torch import nn

import graphquant
from graphquant import recipes, zoo
from graphquant.kernels import backends, block_scaled, emulation, scaled_mm
from graphquant.formats import nvfp4

# What torch._scaled_mm runs on each capability graphquant claims (torch's own tests: per-tensor
# and per-row FP8 from sm89 on, 1x128 / 128x128 block scales on sm90 only, MX and NVFP4 block
# scales from sm100 on); graphquant's native set must stay inside it.
TORCH_RUNS = {
    (8, 9): {scaled_mm.TENSORWISE, scaled_mm.ROWWISE_SCALED},
    (9, 0): {scaled_mm.TENSORWISE, scaled_mm.ROWWISE_SCALED, scaled_mm.BLOCKWISE},
    (10, 0): {scaled_mm.TENSORWISE, scaled_mm.ROWWISE_SCALED, scaled_mm.MXFP8, scaled_mm.NVFP4},
    (12, 0): {scaled_mm.TENSORWISE, scaled_mm.ROWWISE_SCALED, scaled_mm.MXFP8, scaled_mm.NVFP4},
}
# graphquant runs per-tensor and per-row FP8 natively from Hopper on (none of its GEMMs before), and
# on Hopper DeepSeek's fprop and dgrad on its own block-scaled GEMM (graphquant._C.block_gemm).
GRAPHQUANT_RUNS = {sm: set() if sm < (9, 0) else runs | ({block_scaled.BACKEND} if sm == (9, 0) else set()) for sm, runs in TORCH_RUNS.items()}

RECIPES = {
    "delayed_scaling": recipes.delayed_scaling(),
    "current_scaling": recipes.current_scaling(),
    "mxfp8_block_scaling": recipes.mxfp8_block_scaling(),
    "float8_block_scaling": recipes.float8_block_scaling(),
    "nvfp4_block_scaling": recipes.nvfp4_block_scaling(),
    **{f"zoo.{name}": zoo.recipe(name) for name in zoo.FACTORIES},
}
# Recipes of one format: where graphquant runs its GEMMs natively, every GEMM of the model runs on
# one of them (DeepSeek's blocks: 128x128 weight tiles on graphquant's GEMM on Hopper, 1x128 by
# 1x128 on cuBLASLt's).
BLOCKS = frozenset({scaled_mm.BLOCKWISE, block_scaled.BACKEND})
ONE_FORMAT = {
    "delayed_scaling": frozenset({scaled_mm.TENSORWISE}),
    "current_scaling": frozenset({scaled_mm.TENSORWISE}),
    "zoo.tensorwise": frozenset({scaled_mm.TENSORWISE}),
    "zoo.rowwise": frozenset({scaled_mm.ROWWISE_SCALED}),
    "mxfp8_block_scaling": frozenset({scaled_mm.MXFP8}),
    "float8_block_scaling": BLOCKS,
    "zoo.deepseek_blockwise": BLOCKS,
    "nvfp4_block_scaling": frozenset({scaled_mm.NVFP4}),
}

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _unswizzled(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """(rows, cols) block scales from cuBLAS's sm100 layout: 128x4 tiles, row-tile-major, scale
    (r, c) of a tile at byte (r % 32) * 16 + (r // 32) * 4 + c (cuBLAS's block scaling factors
    layout)."""
    assert flat.dim() == 1 and flat.is_contiguous(), "block-scaled scales are one contiguous swizzled vector"
    assert flat.numel() == _round_up(rows, 128) * _round_up(cols, 4), f"{flat.numel()} scales for a {rows}x{cols} grid"
    r, c = torch.arange(rows)[:, None], torch.arange(cols)[None, :]
    tile = (r // 128) * (_round_up(cols, 4) // 4) + c // 4
    return flat[tile * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4]


def _values(data: torch.Tensor, scale: torch.Tensor, mode: str) -> torch.Tensor:
    """float64 values of one operand (rows, K), K contiguous, as its scaling mode reads its scale:
    one per tensor, per row, per (1 or 128 rows) x (16, 32 or 128 columns) block."""
    if mode == "nvfp4":
        codes = nvfp4.e2m1_values(nvfp4.unpack(data.view(torch.uint8))).double()
    else:
        codes = data.double()
    rows, k = codes.shape
    block = {"nvfp4": 16, "mxfp8": 32}.get(mode, 128)
    if mode == "nvfp4":
        scale = _unswizzled(scale, rows, k // block).double()
    elif mode == "mxfp8":
        scale = torch.exp2(_unswizzled(scale, rows, k // block).view(torch.uint8).double() - 127)
    elif mode == "tensorwise":
        scale = scale.double().reshape(1, 1)
    else:  # per row (rows, 1), or per block (rows or row blocks, K blocks)
        scale = scale.double()
    if mode == "block 128x128":
        scale = scale.repeat_interleave(128, dim=0)[:rows]
    if scale.shape[1] > 1:
        scale = scale.repeat_interleave(block, dim=1)[:, :k]
    return codes * scale


def _scaling_mode(a, b, scale_a, scale_b) -> tuple[str, str]:
    """The scaling modes torch._scaled_mm reads from the scales, as its dispatch does; the
    second operand's scale of a non-swizzled mode is given transposed, (K blocks, N)."""
    m, k = a.shape
    n = b.shape[1]
    if scale_a.dtype == torch.float8_e8m0fnu and scale_b.dtype == torch.float8_e8m0fnu:
        assert a.dtype in FP8 and b.dtype in FP8, "MXFP8 multiplies FP8 data"
        return "mxfp8", "mxfp8"
    if scale_a.dtype == torch.float8_e4m3fn and scale_b.dtype == torch.float8_e4m3fn:
        assert a.dtype == b.dtype == torch.float4_e2m1fn_x2, "NVFP4 multiplies packed E2M1 data"
        return "nvfp4", "nvfp4"
    assert scale_a.dtype == scale_b.dtype == torch.float32, f"scales of dtype {scale_a.dtype}, {scale_b.dtype}"
    assert a.dtype in FP8 and b.dtype in FP8, "FP8 scaling multiplies FP8 data"
    if scale_a.numel() == scale_b.numel() == 1:
        return "tensorwise", "tensorwise"
    if scale_a.shape == (m, 1) and scale_b.shape == (1, n):
        assert scale_a.is_contiguous() and scale_b.is_contiguous(), "per-row scales must be contiguous"
        return "rowwise", "rowwise"
    k_blocks = math.ceil(k / 128)
    # 1x128 scales lie outer-dim-major; 128x128 ones row-major (strides of size-1 dims are free).
    assert scale_a.shape == (m, k_blocks) and scale_a.stride(0) == 1, f"1x128 scale_a {scale_a.shape} {scale_a.stride()}"
    assert k_blocks == 1 or scale_a.stride(1) == m, f"1x128 scale_a strides {scale_a.stride()}"
    if scale_b.shape == (k_blocks, n):
        assert scale_b.stride(1) == 1 and (k_blocks == 1 or scale_b.stride(0) == n), f"1x128 scale_b {scale_b.stride()}"
        return "block 1x128", "block 1x128"
    assert scale_b.shape == (k_blocks, math.ceil(n / 128)), f"block scale_b of shape {tuple(scale_b.shape)}"
    assert scale_b.stride(0) == 1 and (scale_b.shape[1] == 1 or scale_b.stride(1) == k_blocks), f"128x128 scale_b {scale_b.stride()}"
    # On the H200 cuBLASLt took 128x128 scales of any k and multiplied by the wrong ones, silently,
    # where k / 128 was not a multiple of 4 (scaled_mm.TILE_SCALED_K).
    assert k_blocks % 4 == 0, f"128x128 scaling of k = {k}: {k_blocks} blocks a tile row, not a multiple of 4"
    return "block 1x128", "block 128x128"


def fake_scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
    """torch._scaled_mm(a (M, K), b (K, N)) as cuBLASLt takes it: a row-major and b column-major
    (the reduction dim contiguous in both, rows of whole 16 bytes), scales as the scaling mode
    wants them; returns the product they describe (float64, one rounding to out_dtype)."""
    assert a.dim() == b.dim() == 2 and a.shape[1] == b.shape[0], f"shapes {tuple(a.shape)} @ {tuple(b.shape)}"
    assert a.stride(1) == 1 and a.stride(0) >= a.shape[1] and a.stride(0) % 16 == 0, f"a not row-major: {a.stride()}"
    assert b.stride(0) == 1 and b.stride(1) >= b.shape[0] and b.stride(1) % 16 == 0, f"b not column-major: {b.stride()}"
    assert a.shape[1] % 16 == 0 and b.shape[0] % 16 == 0 and b.shape[1] % 16 == 0, f"dims of {tuple(b.shape)} not multiples of 16"
    assert not (a.dtype == b.dtype == torch.float8_e5m2), "cuBLASLt does not multiply e5m2 by e5m2"
    assert scale_result is None
    mode_a, mode_b = _scaling_mode(a, b, scale_a, scale_b)
    assert not (use_fast_accum and mode_a not in ("tensorwise", "rowwise")), f"fast accumulation under {mode_a} scaling"
    if mode_a == "rowwise":
        assert out_dtype == torch.bfloat16, "graphquant takes bf16 from per-row scaling"
    if mode_a == "block 1x128":  # on the H200 cuBLASLt refused 17 rows (CUBLAS_STATUS_NOT_SUPPORTED), took 100
        assert a.shape[0] % 4 == 0, f"1x128 scaling of {a.shape[0]} rows, not a multiple of 4"
    if bias is not None:
        assert out_dtype in (torch.bfloat16, torch.float16) and bias.dtype in (torch.bfloat16, out_dtype), "bias"
        assert bias.shape == (b.shape[1],)
    product = _values(a, scale_a, mode_a) @ _values(b.t(), scale_b.t() if mode_b not in ("mxfp8", "nvfp4") else scale_b, mode_b).t()
    return (product + (0 if bias is None else bias.double())).to(out_dtype or a.dtype)


def fake_fp8_gemm(a, b, scale_a, scale_b, out_dtype, fast_accum, bias=None):
    """graphquant._C.fp8_gemm(a (m, k), b (n, k)): per-tensor or per-row FP8, k contiguous in both."""
    assert a.dtype in FP8 and b.dtype in FP8 and scale_a.dim() == scale_b.dim() == 1
    assert scale_a.numel() == scale_b.numel() == 1 or (scale_a.numel(), scale_b.numel()) == (a.shape[0], b.shape[0])
    assert out_dtype in (torch.bfloat16, torch.float16, torch.float32)
    assert bias is None or (bias.dtype == out_dtype != torch.float32 and bias.is_contiguous())
    return fake_scaled_mm(a, b.t(), scale_a.reshape(-1, 1), scale_b.reshape(1, -1), bias, out_dtype=out_dtype, use_fast_accum=fast_accum)


def fake_block_gemm(a, b, a_scale, b_scale, out_dtype, bias, splits):
    """graphquant._C.block_gemm(a (m, k), b (n, k)): FP8 codes, k contiguous in rows of whole 16
    bytes (TMA's), a's 1x128 scales (m, k blocks) and b's 128x128 ones (n tiles, k blocks) in any
    strides, K's split (0: the kernel's choice); returns the product they describe (float64, the
    bias, one rounding to out_dtype)."""
    m, k = a.shape
    n, blocks = b.shape[0], math.ceil(k / 128)
    for codes in (a, b):
        assert codes.dtype in FP8 and codes.dim() == 2 and codes.shape[1] == k, f"codes {codes.dtype} {tuple(codes.shape)}"
        assert codes.stride(1) == 1 and codes.stride(0) % 16 == 0, f"codes strides {codes.stride()}: not k-contiguous rows of whole 16 bytes"
    assert a_scale.dtype == b_scale.dtype == torch.float32
    assert a_scale.shape == (m, blocks) and b_scale.shape == (math.ceil(n / 128), blocks), f"scales {tuple(a_scale.shape)} {tuple(b_scale.shape)}"
    assert out_dtype in (torch.bfloat16, torch.float16, torch.float32)
    assert bias is None or (bias.dtype in (torch.bfloat16, torch.float16) and bias.shape == (n,) and bias.is_contiguous())
    assert isinstance(splits, int) and splits >= 0, f"splits {splits!r}"
    product = _values(a, a_scale, "block 1x128") @ _values(b, b_scale, "block 128x128").t()
    return (product + (0 if bias is None else bias.double())).to(out_dtype)


class Model(nn.Module):
    """fc1 (bias) -> gelu -> fc2, then a matmul of two activations; every dim 128 or 256, so
    every format's native GEMM takes every GEMM."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(128, 256)
        self.fc2 = nn.Linear(256, 128, bias=False)

    def forward(self, x):
        return torch.mm(self.fc2(F.gelu(self.fc1(x))), x.t())


@pytest.fixture
def fake_gpu(monkeypatch):
    """fake_gpu(sm): CPU tensors run the native GEMMs of compute capability sm, through the stand-ins;
    gives the list of (backend, out, expected, bound) of every native GEMM run."""
    calls = []
    run, block_gemm = scaled_mm.run, block_scaled.gemm

    def checked_run(backend, a, b, out_dtype, bias=None):
        return recorded(backend.name, run(backend, a, b, out_dtype, bias), a, b, out_dtype, bias)

    def checked_block_gemm(a, b, out_dtype, bias=None):
        return recorded(block_scaled.BACKEND, block_gemm(a, b, out_dtype, bias), a, b, out_dtype, bias)

    def recorded(backend, out, a, b, out_dtype, bias):
        # The representations' own float64 product: the stand-in's differs by the rounding of each
        # dequantized operand to fp32 and of the scales' products (2^-24 each, four at most), the
        # float64 sums, and the roundings of the output (two of bf16 where a bias follows a bf16 GEMM).
        left, right = a.gemm_operand(torch.float64), b.gemm_operand(torch.float64)
        expected = left @ right.t() + (0 if bias is None else bias.double())
        magnitude = left.abs() @ right.abs().t()
        rounding = 2.0**-24 if out_dtype == torch.float32 else 2 * 2.0**-8
        bound = magnitude * 2.0**-21 + (expected.abs() + (0 if bias is None else bias.double().abs())) * rounding
        calls.append((backend, out, expected, bound))
        return out

    def start(sm):
        monkeypatch.setattr(backends, "capability", lambda device: sm)
        monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm)
        # graphquant._C's GEMMs for the faked GPU (the CPU tensors' quantizes take the reference)
        fake_extension = types.SimpleNamespace(fp8_gemm=fake_fp8_gemm, block_gemm=fake_block_gemm, cuda_archs=(sm[0] * 10 + sm[1],))
        for module in (scaled_mm, block_scaled):
            monkeypatch.setattr(module, "native", types.SimpleNamespace(extension_for=lambda device: fake_extension))
        monkeypatch.setattr(scaled_mm, "run", checked_run)
        monkeypatch.setattr(block_scaled, "gemm", checked_block_gemm)
        if backends.triton_decode is not None:
            monkeypatch.setattr(backends.triton_decode, "gemm", lambda a, b, out_dtype, bias=None: emulation.gemm(a, b, 1, out_dtype, bias)[0])
        backends.clear_caches()
        return calls

    yield start
    backends.clear_caches()


@pytest.mark.parametrize("recipe", RECIPES, ids=list(RECIPES))
@pytest.mark.parametrize("sm", GRAPHQUANT_RUNS, ids=[f"sm{a}{b}" for a, b in GRAPHQUANT_RUNS])
def test_every_native_gemm_gets_arguments_its_gemm_takes(fake_gpu, sm, recipe):
    calls = fake_gpu(sm)
    torch.manual_seed(0)
    model = Model().to(torch.bfloat16)
    x = torch.randn(128, 128, dtype=torch.bfloat16, requires_grad=True)
    compiled = graphquant.compile(model, RECIPES[recipe], backend="eager", fullgraph=True)
    compiled(x).float().square().mean().backward()

    plan = compiled.graphquant.plan
    native = [g.backend.name for g in plan.gemms if g.bucket == backends.NATIVE]
    decode = [gemm.backend for gemm in backends.DECODE_GEMMS]
    planned = collections.Counter(b for b in native if b not in (backends.HIGH_PRECISION, *decode))
    assert set(planned) <= GRAPHQUANT_RUNS[sm], f"planned {set(planned)} on sm_{sm[0]}{sm[1]}\n{plan}"
    assert collections.Counter(backend for backend, *_ in calls) == planned, f"plan and run disagree\n{plan}"
    if recipe in ONE_FORMAT and ONE_FORMAT[recipe] & GRAPHQUANT_RUNS[sm]:
        assert len(native) == len(plan.gemms) and set(native) == ONE_FORMAT[recipe] & GRAPHQUANT_RUNS[sm], str(plan)
    for backend, out, expected, bound in calls:
        excess = ((out.double() - expected).abs() - bound).max().item()
        assert excess <= 0, f"{backend}: the arguments describe another product (by {excess})"


class Linears(nn.Module):
    """fc1 (bias) -> gelu -> fc2: a step's GEMMs whose m (fprop, dgrad) and k (wgrad) are the tokens."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(128, 256)
        self.fc2 = nn.Linear(256, 128, bias=False)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


FP8_ONE_FORMAT = [name for name, natives in ONE_FORMAT.items() if natives & set(scaled_mm.FP8_MULTIPLES)]


@pytest.mark.parametrize("sms", [132, 1], ids=["per-row-scaled-after", "per-row-in-the-gemm"])
@pytest.mark.parametrize("tokens", [100, 33])
@pytest.mark.parametrize("recipe", FP8_ONE_FORMAT)
def test_fp8_gemms_run_on_cublaslt_at_any_number_of_tokens(fake_gpu, recipe, tokens, sms, monkeypatch):
    """A step of 100 or 33 tokens (no multiple of 16, nor 33 of 4) runs every FP8 GEMM on cuBLASLt,
    not on the emulation (5-20x slower on the H200): A's rows padded where the block scaling needs
    it, and wgrad's reduction over the tokens padded with zero codes, with arguments cuBLASLt takes
    and the representations' product; per row, with the scales applied after a product per tensor
    where its tiles would leave most of an H200's SMs idle (scaled_mm.per_row_scaled_after), or in the
    GEMM on a GPU of one SM."""
    monkeypatch.setattr(scaled_mm.devices, "multiprocessors", lambda device: sms)
    calls = fake_gpu((9, 0))
    torch.manual_seed(0)
    x = torch.randn(tokens, 128, dtype=torch.bfloat16, requires_grad=True)
    compiled = graphquant.compile(Linears().to(torch.bfloat16), RECIPES[recipe], backend="eager", fullgraph=True)
    compiled(x).float().square().mean().backward()
    plan = compiled.graphquant.plan
    assert {g.backend.name for g in plan.gemms} <= ONE_FORMAT[recipe] and len(plan.gemms) == 6, str(plan)
    assert len(calls) == 6
    for backend, out, expected, bound in calls:
        excess = ((out.double() - expected).abs() - bound).max().item()
        assert excess <= 0, f"{backend}: the arguments describe another product (by {excess})"


@pytest.mark.parametrize("recipe", FP8_ONE_FORMAT)
def test_fp8_gemms_run_on_cublaslt_at_any_number_of_columns(fake_gpu, recipe):
    """A hidden dim of 200 (no multiple of 16, nor of 128) makes three of a step's GEMMs an n cuBLASLt
    does not take (fc1's fprop, fc2's dgrad and wgrad): B's rows are padded with zero codes (ones
    for their scales) and the padded columns dropped, so that every GEMM runs on cuBLASLt with
    arguments it takes and the representations' product, the bias (fc1's) included."""
    calls = fake_gpu((9, 0))
    torch.manual_seed(0)
    x = torch.randn(100, 128, dtype=torch.bfloat16, requires_grad=True)
    model = Linears()
    model.fc1, model.fc2 = nn.Linear(128, 200), nn.Linear(200, 128, bias=False)
    compiled = graphquant.compile(model.to(torch.bfloat16), RECIPES[recipe], backend="eager", fullgraph=True)
    out = compiled(x)
    out.float().square().mean().backward()
    plan = compiled.graphquant.plan
    assert {g.backend.name for g in plan.gemms} <= ONE_FORMAT[recipe] and len(plan.gemms) == 6, str(plan)
    assert len(calls) == 6 and out.shape == (100, 128) and out.is_contiguous()
    for backend, out, expected, bound in calls:
        assert out.shape == expected.shape and out.is_contiguous()
        excess = ((out.double() - expected).abs() - bound).max().item()
        assert excess <= 0, f"{backend}: the arguments describe another product (by {excess})"


def test_block_scale_swizzle_is_torchs():
    """graphquant lays out MXFP8 and NVFP4 scales as torch's own tests do for torch._scaled_mm."""
    to_blocked = getattr(pytest.importorskip("torch.testing._internal.common_quantized"), "to_blocked", None)
    if to_blocked is None:
        pytest.skip("this torch has no to_blocked")
    for rows, cols in [(128, 4), (200, 6), (256, 12), (32, 1)]:
        scale = torch.randint(0, 255, (rows, cols), dtype=torch.uint8, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(scaled_mm.swizzled_block_scales(scale), to_blocked(scale).flatten())
