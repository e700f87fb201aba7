"""graphquant._C.fp8_gemm: per-tensor FP8 GEMMs with cuBLASLt's algorithm chosen by timing among
those that write the heuristic's first's bits.

Bit for bit against torch._scaled_mm (the same GEMM with the heuristic's first algorithm) for every
operand type pair, output dtype, accumulation and bias, on shapes too small to time and shapes that
are timed; the choice is listed, kept for later calls, and skipped inside a CUDA graph; bad
arguments are refused with what would be accepted.
"""

import os
import subprocess
import sys

import pytest
import torch

from graphquant.formats import fp8
from graphquant.kernels import native, scaled_mm

pytestmark = pytest.mark.gpu

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
TYPE_PAIRS = [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)]
OUT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (m, n, k): below the size that is timed, an odd-sized one, one of rows no multiple of 16 (the
# plan's cuBLASLt GEMMs take any m), and 2 * m * n * k = 2^34 flops, timed.
SHAPES = [(64, 96, 128), (272, 400, 528), (17, 400, 528), (2048, 2048, 2048)]


def _ext():
    ext = native.extension()
    assert ext is not None, "graphquant._C was built without its CUDA kernels"
    return ext


def _fp8(rows: int, cols: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(rows, cols, device="cuda") * scale).to(dtype)


def _scaled_mm(a, b, sa, sb, out_dtype, fast, bias=None):
    return torch._scaled_mm(a, b.t(), sa, sb, bias=bias, out_dtype=out_dtype, use_fast_accum=fast)


@pytest.mark.parametrize("fast", [False, True], ids=["split", "fast"])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("a_dtype,b_dtype", TYPE_PAIRS, ids=str)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_fp8_gemm_matches_scaled_mm_bit_for_bit(m, n, k, a_dtype, b_dtype, out_dtype, fast):
    torch.manual_seed(0)
    a, b = _fp8(m, k, a_dtype, 4.0), _fp8(n, k, b_dtype)
    sa, sb = torch.tensor(0.37, device="cuda"), torch.tensor(1.9, device="cuda")
    expected = _scaled_mm(a, b, sa, sb, out_dtype, fast)
    first = _ext().fp8_gemm(a, b, sa, sb, out_dtype, fast)
    again = _ext().fp8_gemm(a, b, sa, sb, out_dtype, fast)  # the cached choice
    assert first.dtype == out_dtype and first.shape == (m, n)
    assert torch.equal(first.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(again.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_fp8_gemm_bias_in_the_epilogue_matches_scaled_mm(m, n, k, out_dtype):
    torch.manual_seed(1)
    a, b = _fp8(m, k, E4M3, 2.0), _fp8(n, k, E4M3)
    sa, sb = torch.tensor(0.5, device="cuda"), torch.tensor(0.75, device="cuda")
    bias = torch.randn(n, device="cuda").to(out_dtype) * 8
    out = _ext().fp8_gemm(a, b, sa, sb, out_dtype, True, bias)
    assert torch.equal(out.view(torch.uint8), _scaled_mm(a, b, sa, sb, out_dtype, True, bias).view(torch.uint8))
    assert not torch.equal(out, _ext().fp8_gemm(a, b, sa, sb, out_dtype, True))


@pytest.mark.parametrize("fast", [False, True], ids=["split", "fast"])
@pytest.mark.parametrize("m,n,k", SHAPES + [(17, 4096, 14336)])
def test_fp8_gemm_per_row_is_the_float64_product_within_its_bound(m, n, k, fast):
    """Per-row scales (cuBLASLt's outer-vector scaling): the float64 product of the scaled codes
    within fp8.accumulation_bound, plus a rounding for each scale and the bf16 output's."""
    torch.manual_seed(5)
    a, b = _fp8(m, k, E4M3, 4.0), _fp8(n, k, E4M3)
    sa, sb = torch.rand(m, device="cuda") + 0.5, torch.rand(n, device="cuda") * 2
    out = _ext().fp8_gemm(a, b, sa, sb, torch.bfloat16, fast)
    left, right = a.double() * sa.double()[:, None], (b.double() * sb.double()[:, None]).t()
    ref = left @ right
    bound = fp8.accumulation_bound(left, right, fp8.FAST if fast else fp8.PROMOTED_PRODUCTS)
    bound = bound + 3 * 2.0**-24 * (left.abs() @ right.abs()) + ref.abs() * 2.0**-8
    assert ((out.double() - ref).abs() - bound).max().item() <= 0
    assert torch.equal(out, _ext().fp8_gemm(a, b, sa, sb, torch.bfloat16, fast))  # the cached choice: same bits


def test_fp8_gemm_reads_a_leading_stride_past_k():
    """Rows of a wider buffer (a view): the leading stride, not k, steps from row to row."""
    torch.manual_seed(2)
    wide_a, wide_b = _fp8(128, 256, E4M3), _fp8(96, 192, E4M3)
    a, b = wide_a[:, :160], wide_b[:, :160]
    one = torch.tensor(1.0, device="cuda")
    out = _ext().fp8_gemm(a, b, one, one, torch.float32, False)
    assert torch.equal(out, _scaled_mm(a.contiguous(), b.contiguous(), one, one, torch.float32, False))


def test_timed_choice_is_listed():
    torch.manual_seed(3)
    m, n, k = 2048, 3072, 2048
    a, b = _fp8(m, k, E4M3), _fp8(n, k, E4M3)
    one = torch.tensor(1.0, device="cuda")
    _ext().fp8_gemm(a, b, one, one, torch.bfloat16, True)
    rows = [dict(zip(scaled_mm.ALGORITHM_FIELDS, c)) for c in scaled_mm.algorithm_choices()]
    mine = [r for r in rows if r["GEMM"] == f"fp8_gemm e4m3 ({m} x {k}) @ e4m3 ({n} x {k})^T -> BFloat16, fast accumulation"]
    assert len(mine) == 1, rows
    choice = mine[0]
    assert 1 <= choice["bit-identical"] <= choice["candidates"] and 0 <= choice["chosen"] < choice["candidates"]
    assert 0 < choice["chosen us"] <= choice["first us"]


def test_fp8_gemm_in_a_cuda_graph_on_a_shape_not_seen_before():
    """Inside a capture nothing is timed (no host synchronisation): the heuristic's first runs and
    nothing is cached, so a later call outside the graph still times the shape."""
    torch.manual_seed(4)
    m, n, k = 2048, 2048, 4096
    a, b = _fp8(m, k, E4M3), _fp8(n, k, E5M2)
    sa, sb = torch.tensor(0.5, device="cuda"), torch.tensor(2.0, device="cuda")
    # CUDA graphs need their libraries' handles made before a capture: in a process whose first
    # cuBLAS call is inside one, cublasCreate fails and the failed capture spoils what runs after it.
    _ext().fp8_gemm(a[:64], b[:64], sa, sb, torch.bfloat16, False)
    before = len(scaled_mm.algorithm_choices())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _ext().fp8_gemm(a, b, sa, sb, torch.bfloat16, False)
    assert len(scaled_mm.algorithm_choices()) == before
    a.copy_(_fp8(m, k, E4M3))
    sa.fill_(0.25)
    graph.replay()
    expected = _scaled_mm(a, b, sa, sb, torch.bfloat16, False)
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    assert torch.equal(_ext().fp8_gemm(a, b, sa, sb, torch.bfloat16, False).view(torch.int16), expected.view(torch.int16))
    assert len(scaled_mm.algorithm_choices()) == before + 1


def test_all_zero_output_is_not_taken_as_agreement():
    """Every algorithm writes zeros for a zero operand, so that call proves nothing about their
    sums: the shape is timed later, on a product that tells them apart."""
    m, n, k = 2048, 2048, 2560
    a, b = torch.zeros(m, k, device="cuda").to(E4M3), _fp8(n, k, E4M3)
    one = torch.tensor(1.0, device="cuda")
    before = len(scaled_mm.algorithm_choices())
    assert not _ext().fp8_gemm(a, b, one, one, torch.bfloat16, False).any()
    assert len(scaled_mm.algorithm_choices()) == before
    a = _fp8(m, k, E4M3)
    assert torch.equal(_ext().fp8_gemm(a, b, one, one, torch.bfloat16, False), _scaled_mm(a, b, one, one, torch.bfloat16, False))
    assert len(scaled_mm.algorithm_choices()) == before + 1


def test_timing_turned_off_takes_the_heuristics_first():
    """GRAPHQUANT_GEMM_TUNING=0 (read once per process, so in a fresh one): a shape large enough to
    be timed is listed with nothing timed, chosen index 0, and the same bits."""
    program = """
import torch
from graphquant.kernels import native, scaled_mm
a = (torch.randn(2048, 2048, device="cuda") * 4).to(torch.float8_e4m3fn)
b = torch.randn(2048, 2048, device="cuda").to(torch.float8_e4m3fn)
one = torch.tensor(1.0, device="cuda")
out = native.extension().fp8_gemm(a, b, one, one, torch.bfloat16, True)
assert torch.equal(out, torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16, use_fast_accum=True))
(choice,) = [dict(zip(scaled_mm.ALGORITHM_FIELDS, c)) for c in scaled_mm.algorithm_choices()]
assert choice["chosen"] == 0 and choice["chosen us"] == choice["first us"] == 0, choice
"""
    env = {**os.environ, "GRAPHQUANT_GEMM_TUNING": "0"}
    result = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def test_fp8_gemm_refuses_bad_arguments():
    ext = _ext()
    a, b, one = _fp8(64, 128, E4M3), _fp8(32, 128, E4M3), torch.tensor(1.0, device="cuda")
    with pytest.raises(RuntimeError, match="float8_e4m3fn by float8_e4m3fn or float8_e5m2"):
        ext.fp8_gemm(a.to(torch.float32).to(E5M2), b.to(torch.float32).to(E5M2), one, one, torch.bfloat16, False)
    with pytest.raises(RuntimeError, match=r"last \(reduction\) dim contiguous"):
        ext.fp8_gemm(a.t().contiguous().t(), b, one, one, torch.bfloat16, False)
    with pytest.raises(RuntimeError, match="takes a \\(m, k\\) and b \\(n, k\\)"):
        ext.fp8_gemm(a, _fp8(32, 64, E4M3), one, one, torch.bfloat16, False)
    with pytest.raises(RuntimeError, match=r"one value each \(per tensor\) or 64 for a and 32 for b \(per row\)"):
        ext.fp8_gemm(a, b, torch.ones(2, device="cuda"), one, torch.bfloat16, False)
    with pytest.raises(RuntimeError, match="contiguous bias of out_dtype"):
        ext.fp8_gemm(a, b, one, one, torch.float32, False, torch.zeros(32, device="cuda"))
    with pytest.raises(RuntimeError, match="contiguous bias of out_dtype"):
        ext.fp8_gemm(a, b, one, one, torch.bfloat16, False, torch.zeros(31, device="cuda", dtype=torch.bfloat16))
