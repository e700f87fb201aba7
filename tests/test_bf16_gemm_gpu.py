"""graphquant._C.bf16_gemm: alpha * (A @ B^T) (+ bias) per batch in cuBLASLt, alpha read from the
device, the bias added in the epilogue.

Against float64 within fp32 accumulation error; bit for bit where the accumulation is exact, which
shows the product is rounded once, after alpha (and after the bias, added along out's last dim, the
same for every batch); inside a CUDA graph; its checks on the bias; and behind emulation.gemm.
"""

import pytest
import torch

from graphquant.formats import fp8
from graphquant.kernels import emulation, native
from graphquant.quantizers import ROWWISE, IdentityQuantizer, NVFP4Quantizer, QuantizeContext

pytestmark = pytest.mark.gpu

OUT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}

# (batch, m, n, k): one and several batches, sizes off powers of two; every leading dim (k, n,
# and m where A is column-major) a multiple of 8, as cuBLASLt's 16-byte-aligned kernels need.
SHAPES = [(1, 8, 8, 8), (1, 256, 384, 512), (3, 24, 40, 72), (4, 136, 264, 520)]
LAYOUTS = [("row", "row"), ("row", "col"), ("col", "row"), ("col", "col")]


def _ext():
    ext = native.extension()
    assert ext is not None, "graphquant._C was built without its CUDA kernels"
    return ext


def _stored(x: torch.Tensor, layout: str) -> torch.Tensor:
    """x as bf16 on the GPU, each matrix stored row-major or column-major (a transposed view)."""
    x = x.to(torch.bfloat16).cuda()
    return x if layout == "row" else x.mT.contiguous().mT


def _fp32_error(a: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """How far alpha (a @ b^T) of bf16 operands may lie from the exact product before its output's
    rounding: the products' fp32 sums (fp8.accumulation_bound) and the multiply by alpha."""
    a, b = a.double(), b.double().mT
    return (fp8.accumulation_bound(a, b, fp8.FP32) + 2.0**-24 * (a.abs() @ b.abs())) * alpha.double()


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("a_layout,b_layout", LAYOUTS)
@pytest.mark.parametrize("batch,m,n,k", SHAPES)
def test_bf16_gemm_matches_float64(batch, m, n, k, a_layout, b_layout, out_dtype):
    torch.manual_seed(0)
    a = _stored(torch.randn(batch, m, k) * 4, a_layout)
    b = _stored(torch.randn(batch, n, k), b_layout)
    alpha = torch.tensor(0.37, device="cuda")
    out = _ext().bf16_gemm(a, b, alpha, out_dtype)
    assert out.shape == (batch, m, n) and out.dtype == out_dtype
    ref = a.double() @ b.double().mT * alpha.double()
    # fp32 sums and the multiply by alpha, then one rounding to out_dtype (relative, or half a
    # subnormal step).
    fp32_error = _fp32_error(a, b, alpha)
    tiny = torch.finfo(out_dtype).smallest_normal
    bound = fp32_error + (ref.abs() + fp32_error + tiny) * UNIT_ROUNDOFF[out_dtype]
    excess = ((out.double() - ref).abs() - bound).max().item()
    assert excess <= 0, f"error exceeds the bound by {excess}"


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("alpha", [2.0**-5, 0.3, 1.7e-3])
def test_bf16_gemm_rounds_once_after_alpha(alpha, out_dtype):
    """Small integers accumulate exactly in fp32 in any order, so out must be exactly that sum times
    alpha in fp32, rounded once to out_dtype: rounding before alpha would differ unless alpha is a
    power of two."""
    torch.manual_seed(0)
    batch, m, n, k = 2, 7, 16, 520
    a = torch.randint(-8, 9, (batch, m, k)).to(torch.bfloat16).cuda()
    b = torch.randint(-8, 9, (batch, n, k)).to(torch.bfloat16).cuda()
    exact = (a.double() @ b.double().mT).float()  # |sums| <= 520 * 64 < 2^24
    alpha = torch.tensor(alpha, device="cuda")
    expected = (exact * alpha).to(out_dtype)
    # Freed NaNs, likely where out lands: with beta = 0 cuBLASLt must not read them.
    torch.full((batch, m, n), float("nan"), device="cuda")
    out = _ext().bf16_gemm(a, b, alpha, out_dtype)
    assert torch.equal(out.view(BITS[out_dtype]), expected.view(BITS[out_dtype]))


def _bias_dtypes(out_dtype):
    """What bf16_gemm takes for a bias with out_dtype: bfloat16 or out_dtype."""
    return [torch.bfloat16] if out_dtype == torch.bfloat16 else [torch.bfloat16, out_dtype]


BIAS_CASES = [(out, bias) for out in OUT_DTYPES for bias in _bias_dtypes(out)]


@pytest.mark.parametrize("out_dtype,bias_dtype", BIAS_CASES, ids=str)
@pytest.mark.parametrize("alpha", [0.375, 0.3])
@pytest.mark.parametrize("a_layout,b_layout", LAYOUTS)
@pytest.mark.parametrize("batch", [1, 3])
def test_bf16_gemm_bias_rounds_once_after_alpha_and_bias(
    batch, a_layout, b_layout, alpha, out_dtype, bias_dtype
):
    """As test_bf16_gemm_rounds_once_after_alpha, with a bias: out[g, i, j] must be exactly
    alpha * sum_k a[g, i, k] b[g, j, k] + bias[j] in fp32, rounded once to out_dtype.

    The sums are exact integers (|sum| <= 520 * 64) and the bias values multiples of 1/8 below 128,
    so with alpha = 3/8 the fp32 value alpha * sum + bias is exact however the epilogue orders or
    fuses it, and the result must equal the reference bit for bit; rounding to out_dtype before the
    bias (or before alpha) would differ. With alpha = 0.3, alpha * sum rounds in fp32, and an epilogue
    may add the bias after that rounding or in the same fused multiply-add: each element must be one
    of those two fp32 values, rounded once to out_dtype. m != n, and batch 3 shares one bias."""
    torch.manual_seed(0)
    m, n, k = 24, 40, 520
    a = _stored(torch.randint(-8, 9, (batch, m, k)), a_layout)
    b = _stored(torch.randint(-8, 9, (batch, n, k)), b_layout)
    bias = (torch.randint(-1024, 1025, (n,)) / 8).to(bias_dtype).cuda()
    assert (bias.double() * 8 == (bias.double() * 8).round()).all() and bias.abs().max() <= 128
    exact = (a.double() @ b.double().mT).float()  # integers below 2^24
    alpha = torch.tensor(alpha, device="cuda")
    separate = exact * alpha + bias.float()  # fp32: alpha * sum rounded, then + bias rounded
    fused = (exact.double() * alpha.double() + bias.double()).float()  # one fp32 rounding (exact in float64)
    torch.full((batch, m, n), float("nan"), device="cuda")  # freed NaNs: beta = 0, out is not read
    out = _ext().bf16_gemm(a, b, alpha, out_dtype, bias)
    assert out.shape == (batch, m, n) and out.dtype == out_dtype
    bits = BITS[out_dtype]
    out_bits = out.view(bits)
    separate_bits, fused_bits = separate.to(out_dtype).view(bits), fused.to(out_dtype).view(bits)
    if alpha.item() == 0.375:
        assert torch.equal(fused_bits, separate_bits)
    mismatched = ((out_bits != separate_bits) & (out_bits != fused_bits)).sum().item()
    assert mismatched == 0, f"{mismatched} of {out.numel()} elements are neither reference rounded once"
    # The bias is there: without it the integers times alpha differ from what came out.
    assert not torch.equal(out_bits, (exact * alpha).to(out_dtype).view(bits))


@pytest.mark.parametrize("out_dtype,bias_dtype", BIAS_CASES, ids=str)
def test_bf16_gemm_bias_matches_float64(out_dtype, bias_dtype):
    """Random operands and bias, one batch of several: within the fp32 error bound of the
    bias-free test, plus the fp32 rounding of the bias's sum."""
    torch.manual_seed(0)
    batch, m, n, k = 3, 136, 264, 520
    a = _stored(torch.randn(batch, m, k) * 4, "row")
    b = _stored(torch.randn(batch, n, k), "row")
    bias = (torch.randn(n) * 16).to(bias_dtype).cuda()
    alpha = torch.tensor(0.37, device="cuda")
    out = _ext().bf16_gemm(a, b, alpha, out_dtype, bias)
    ref = a.double() @ b.double().mT * alpha.double() + bias.double()
    fp32_error = _fp32_error(a, b, alpha)
    fp32_error = fp32_error + (ref.abs() + fp32_error) * 2.0**-24
    tiny = torch.finfo(out_dtype).smallest_normal
    bound = fp32_error + (ref.abs() + fp32_error + tiny) * UNIT_ROUNDOFF[out_dtype]
    excess = ((out.double() - ref).abs() - bound).max().item()
    assert excess <= 0, f"error exceeds the bound by {excess}"


@pytest.mark.parametrize(
    "out_dtype,bias_dtype", [(torch.bfloat16, None), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)], ids=str
)
def test_bf16_gemm_in_a_cuda_graph(out_dtype, bias_dtype):
    """No host synchronisation: the call captures (with a bias, for an fp32 out with the bias's
    conversion to fp32), and a replay reads new operands, a new alpha and a new bias."""
    torch.manual_seed(0)
    ext = _ext()
    a = torch.randn(2, 64, 128, device="cuda").to(torch.bfloat16)
    b = torch.randn(2, 96, 128, device="cuda").to(torch.bfloat16)
    bias = None if bias_dtype is None else torch.randn(96, device="cuda").to(bias_dtype)
    alpha = torch.tensor(0.5, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ext.bf16_gemm(a, b, alpha, out_dtype, bias)  # creates the cuBLASLt handle outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ext.bf16_gemm(a, b, alpha, out_dtype, bias)
    a.copy_(torch.randn_like(a))
    b.copy_(torch.randn_like(b))
    if bias is not None:
        bias.copy_(torch.randn_like(bias) * 4)
    alpha.fill_(0.25)
    graph.replay()
    expected = ext.bf16_gemm(a, b, alpha, out_dtype, bias)
    assert torch.equal(out, expected)
    if bias is not None:
        assert not torch.equal(expected, ext.bf16_gemm(a, b, alpha, out_dtype))


def test_bf16_gemm_bias_none_is_no_bias():
    torch.manual_seed(0)
    ext = _ext()
    a = torch.randn(1, 32, 64, device="cuda").to(torch.bfloat16)
    b = torch.randn(1, 48, 64, device="cuda").to(torch.bfloat16)
    alpha = torch.tensor(0.3, device="cuda")
    assert torch.equal(ext.bf16_gemm(a, b, alpha, torch.float32, None), ext.bf16_gemm(a, b, alpha, torch.float32))
    assert torch.equal(ext.bf16_gemm(a, b, alpha, torch.float32, bias=None), ext.bf16_gemm(a, b, alpha, torch.float32))


def test_bf16_gemm_bias_with_empty_k_is_the_bias():
    """k = 0: alpha times an empty sum, plus the bias, rounded once."""
    ext = _ext()
    a = torch.empty(2, 5, 0, device="cuda", dtype=torch.bfloat16)
    b = torch.empty(2, 16, 0, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(16, device="cuda")
    out = ext.bf16_gemm(a, b, torch.tensor(0.5, device="cuda"), torch.float16, bias.to(torch.bfloat16))
    assert torch.equal(out, bias.to(torch.bfloat16).to(torch.float16).expand(2, 5, 16))
    out = ext.bf16_gemm(a, b, torch.tensor(0.5, device="cuda"), torch.float32, bias)
    assert torch.equal(out, bias.expand(2, 5, 16))


def _bias_case():
    a = torch.randn(2, 32, 64, device="cuda").to(torch.bfloat16)
    b = torch.randn(2, 48, 64, device="cuda").to(torch.bfloat16)
    return a, b, torch.tensor(0.5, device="cuda")


def _zeros(*shape, dtype=torch.bfloat16, device="cuda"):
    return lambda: torch.zeros(*shape, dtype=dtype, device=device)


@pytest.mark.parametrize(
    "make_bias,out_dtype,message",
    [
        (_zeros(49), torch.bfloat16, r"1-D of length n = b.shape\[1\] = 48 .*got shape \[49\]"),
        (_zeros(32), torch.bfloat16, r"1-D of length n = b.shape\[1\] = 48 .*got shape \[32\]"),
        (_zeros(1, 48), torch.bfloat16, r"1-D of length n = b.shape\[1\] = 48 .*got shape \[1, 48\]"),
        (_zeros(48, dtype=torch.float32), torch.bfloat16, r"a bias of Float with out_dtype BFloat16; accepted are bfloat16"),
        (_zeros(48, dtype=torch.float16), torch.float32, r"a bias of Half with out_dtype Float; accepted are bfloat16"),
        (_zeros(48, dtype=torch.float64), torch.float32, r"a bias of Double with out_dtype Float; accepted are bfloat16"),
        (_zeros(48, device="cpu"), torch.bfloat16, r"bias must be on the operands' device \(cuda:\d+\), got cpu"),
        (lambda: _zeros(96)()[::2], torch.bfloat16, r"bias must be contiguous, got stride \[2\]"),
        (lambda: _zeros(56)()[1:49], torch.bfloat16, r"16-byte-aligned address, got one 2 bytes past it"),
    ],
    ids=[
        "too long", "length m", "2-D", "fp32 for bf16 out", "fp16 for fp32 out", "fp64", "on the cpu", "strided",
        "misaligned",
    ],
)
def test_bf16_gemm_rejects_a_bad_bias(make_bias, out_dtype, message):
    a, b, alpha = _bias_case()
    with pytest.raises(RuntimeError, match=message):
        _ext().bf16_gemm(a, b, alpha, out_dtype, make_bias())


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_gemm_writes_into_a_slice_of_out(out_dtype, with_bias):
    """Into out[:, rows] and out[:, :, cols] of a larger product (its row stride, not n): the
    values of a fresh result, and nothing outside the slice touched."""
    torch.manual_seed(0)
    ext = _ext()
    a = torch.randn(2, 64, 128, device="cuda").to(torch.bfloat16)
    b = torch.randn(2, 48, 128, device="cuda").to(torch.bfloat16)
    bias = torch.randn(48, device="cuda").to(torch.bfloat16) if with_bias else None
    alpha = torch.tensor(0.37, device="cuda")
    expected = ext.bf16_gemm(a, b, alpha, out_dtype, bias)
    for rows, cols in [(slice(16, 80), slice(0, 48)), (slice(0, 64), slice(24, 72))]:
        whole = torch.full((2, 96, 80), 7.0, dtype=out_dtype, device="cuda")
        target = whole[:, rows, cols]
        assert ext.bf16_gemm(a, b, alpha, out_dtype, bias, out=target).data_ptr() == target.data_ptr()
        assert torch.equal(target, expected)
        outside = torch.ones_like(whole, dtype=torch.bool)
        outside[:, rows, cols] = False
        assert (whole[outside] == 7.0).all()


@pytest.mark.parametrize(
    "make_out,out_dtype,message",
    [
        (_zeros(2, 32, 48, dtype=torch.float32), torch.bfloat16, r"out must be of out_dtype \(BFloat16\).*got Float"),
        (_zeros(2, 32, 48, dtype=torch.float16), torch.float16, r"out must be of out_dtype \(Half\), and bfloat16 or float32"),
        (_zeros(2, 32, 40), torch.bfloat16, r"out must be \(batch, m, n\) = \(2, 32, 48\).*got shape \[2, 32, 40\]"),
        (lambda: _zeros(2, 48, 32)().mT, torch.bfloat16, r"each matrix stored row by row, got shape \[2, 32, 48\] strides \[1536, 1, 32\]"),
        (_zeros(2, 32, 48, device="cpu"), torch.bfloat16, r"on cuda:\d+ with each matrix stored row by row.* on cpu"),
    ],
    ids=["fp32 for bf16 out", "fp16", "wrong n", "column-major", "on the cpu"],
)
def test_bf16_gemm_rejects_a_bad_out(make_out, out_dtype, message):
    a, b, alpha = _bias_case()
    with pytest.raises(RuntimeError, match=message):
        _ext().bf16_gemm(a, b, alpha, out_dtype, out=make_out())


def _rowwise(quantizer, rows, k):
    source = (torch.randn(rows, k) * torch.rand(rows, 1) * 4).to(torch.bfloat16).cuda()
    return quantizer(source, rowwise=True, columnwise=False, ctx=QuantizeContext()).get(ROWWISE)


@pytest.mark.parametrize(
    "batch,n,qb,native",
    [
        (1, 96, NVFP4Quantizer(), True),
        (3, 96, NVFP4Quantizer(), True),
        (1, 96, IdentityQuantizer(), True),
        (1, 13, IdentityQuantizer(), False),
        (1, 96, NVFP4Quantizer(row_scaled_nvfp4=True), False),
    ],
    ids=["nvfp4", "nvfp4 batch 3", "identity", "identity n=13 falls back", "row-scaled falls back"],
)
def test_emulated_gemm_applies_scalar_factors_in_the_epilogue(batch, n, qb, native, monkeypatch):
    torch.manual_seed(0)
    m, k = 64, 256
    a, b = _rowwise(NVFP4Quantizer(), batch * m, k), _rowwise(qb, batch * n, k)
    ext, calls = _ext(), []
    bf16_gemm = ext.bf16_gemm
    monkeypatch.setattr(ext, "bf16_gemm", lambda *args: calls.append(args) or bf16_gemm(*args))
    out = emulation.gemm(a, b, batch, torch.float32).double()
    assert len(calls) == int(native)
    va, vb = a.gemm_operand(torch.float64).reshape(batch, m, k), b.gemm_operand(torch.float64).reshape(batch, n, k)
    # fp32 sums plus one rounding per factor applied.
    bound = fp8.accumulation_bound(va, vb.mT, fp8.FP32) + 3 * 2.0**-24 * (va.abs() @ vb.abs().mT)
    assert ((out - va @ vb.mT).abs() <= bound).all()


def test_sliced_emulated_gemm_writes_each_slice_in_place(monkeypatch):
    """Over ``slice_elements``, each slice's product goes straight into its rows of the output
    (bf16_gemm's out, no copy), and the operands' global factors make one alpha for every slice."""
    torch.manual_seed(0)
    m, n, k = 512, 96, 256
    a, b = _rowwise(NVFP4Quantizer(), m, k), _rowwise(NVFP4Quantizer(), n, k)
    ext, calls = _ext(), []
    bf16_gemm = ext.bf16_gemm
    monkeypatch.setattr(ext, "bf16_gemm", lambda *args: calls.append(args) or bf16_gemm(*args))
    out = emulation.gemm(a, b, 1, torch.bfloat16, slice_elements=128 * k)
    assert [args[5].data_ptr() for args in calls] == [out[:, start:].data_ptr() for start in range(0, m, 128)]
    assert len({args[2].data_ptr() for args in calls}) == 1
    va, vb = a.gemm_operand(torch.float64), b.gemm_operand(torch.float64)
    ref = va @ vb.t()
    bound = fp8.accumulation_bound(va, vb.t(), fp8.FP32) + 3 * 2.0**-24 * (va.abs() @ vb.abs().t()) + ref.abs() * 2.0**-8
    assert ((out[0].double() - ref).abs() <= bound).all()
