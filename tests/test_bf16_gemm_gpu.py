"""graphquant._C.bf16_gemm: alpha * (A @ B^T) per batch in cuBLASLt, alpha read from the device.

Against float64 within fp32 accumulation error; bit for bit where the accumulation is exact, which
shows the product is rounded once, after alpha; inside a CUDA graph; and behind emulation.gemm.
"""

import pytest
import torch

from graphquant import emulation, kernels
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
    ext = kernels.native()
    assert ext is not None, "graphquant._C was built without its CUDA kernels"
    return ext


def _stored(x: torch.Tensor, layout: str) -> torch.Tensor:
    """x as bf16 on the GPU, each matrix stored row-major or column-major (a transposed view)."""
    x = x.to(torch.bfloat16).cuda()
    return x if layout == "row" else x.mT.contiguous().mT


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
    # fp32 accumulation of k products and the multiply by alpha ((k + 1) * 2^-24 per unit of
    # alpha * sum|a||b|), then one rounding to out_dtype (relative, or half a subnormal step).
    fp32_error = (a.double().abs() @ b.double().abs().mT) * alpha.double() * (k + 1) * 2.0**-24
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


def test_bf16_gemm_in_a_cuda_graph():
    """No host synchronisation: the call captures, and a replay reads new operands and a new alpha."""
    torch.manual_seed(0)
    ext = _ext()
    a = torch.randn(2, 64, 128, device="cuda").to(torch.bfloat16)
    b = torch.randn(2, 96, 128, device="cuda").to(torch.bfloat16)
    alpha = torch.tensor(0.5, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ext.bf16_gemm(a, b, alpha, torch.bfloat16)  # creates the cuBLASLt handle outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ext.bf16_gemm(a, b, alpha, torch.bfloat16)
    a.copy_(torch.randn_like(a))
    b.copy_(torch.randn_like(b))
    alpha.fill_(0.25)
    graph.replay()
    assert torch.equal(out, ext.bf16_gemm(a, b, alpha, torch.bfloat16))


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
    # fp32 accumulation (k * 2^-24 per unit of sum|a||b|) plus one rounding per factor applied.
    bound = (va.abs() @ vb.abs().mT) * (k + 3) * 2.0**-24
    assert ((out - va @ vb.mT).abs() <= bound).all()
