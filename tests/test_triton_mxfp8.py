"""The native MXFP8 GEMM for Hopper (graphquant.kernels.triton_mxfp8): every direction of a
linear's GEMMs (fprop, dgrad and wgrad: MXFP8's columnwise data read through transposed views)
equals the float64 product of the dequantized operands (graphquant.formats' MXFP8 numerics)
within the bound of promoted FP8 tensor-core sums, rows and columns that fill no tile, a bias,
E5M2 on either side; E8M0's edge codes exactly; and the plan puts every MXFP8 GEMM of a Hopper
on it but those the decode GEMM takes.

On the CPU the kernel runs under Triton's interpreter, in a process of its own, with an fp32
output and exact products (the interpreter's FP8 dot widened as the tensor cores read it): within
fp32 accumulation. On the GPU at a Llama-3-8B FFN's widths with a bf16 output.
"""

import json

import pytest
import torch
import triton_interpreter

from graphquant.formats import mxfp8
from graphquant.kernels import backends
from graphquant.quantizers import COLUMNWISE, ROWWISE, MXFP8Quantizer, QuantizeContext

U = 2.0**-24
# (GEMM, direction of A, direction of B): the operands' directions in a linear's three GEMMs.
LAYOUTS = {"fprop": (ROWWISE, ROWWISE), "dgrad": (ROWWISE, COLUMNWISE), "wgrad": (COLUMNWISE, COLUMNWISE)}
# (A's element, B's): MXFP8 recipes' E4M3, and E5M2 gradients (dgrad's A, wgrad's A).
ELEMENTS = {"e4m3": ("e4m3", "e4m3"), "e5m2 x e4m3": ("e5m2", "e4m3")}
# (m, n, k): rows and columns that fill no 64- or 128-wide tile; k a multiple of MXFP8's 32.
INTERPRETED_SHAPE = (70, 100, 96)
GPU_SHAPES = [(16, 4096, 4096), (300, 14336, 4096), (2048, 4096, 14336)]


def _operand(element: str, direction: str, rows: int, k: int, device: str, generator: torch.Generator):
    """An MXFP8 representation whose GEMM operand is (rows, k) (columnwise: of a (k, rows) source),
    its rows' magnitudes spread over 2^-8..2^8 so that the blocks' scales differ."""
    shape = (rows, k) if direction == ROWWISE else (k, rows)
    source = torch.randn(shape, generator=generator) * 2.0 ** torch.randint(-8, 9, (shape[0], 1), generator=generator)
    quantizer = MXFP8Quantizer(element)
    qt = quantizer(source.to(torch.bfloat16).to(device), rowwise=direction == ROWWISE, columnwise=direction == COLUMNWISE, ctx=QuantizeContext())
    return qt.get(direction)


def excess(gemm: str, elements: str, m: int, n: int, k: int, out_dtype: torch.dtype, device: str) -> float:
    """How far the kernel's ``gemm`` of (m, n, k) with a bias exceeds its bound (<= 0: within
    it): fp32 accumulation ((k + 4) u sum |a b|) where the products are exact (the interpreter),
    promoted tensor-core sums (2^-9 sum |a b|) on the GPU; plus the rounding to ``out_dtype``."""
    generator = torch.Generator().manual_seed(0)
    (da, db), (ea, eb) = LAYOUTS[gemm], ELEMENTS[elements]
    a, b = _operand(ea, da, m, k, device, generator), _operand(eb, db, n, k, device, generator)
    bias = torch.randn(n, generator=generator).to(device, torch.bfloat16)
    out = backends.triton_mxfp8.gemm(a, b, out_dtype, bias)
    left, right = a.gemm_operand(torch.float64), b.gemm_operand(torch.float64)
    exact = left @ right.t() + bias.double()
    magnitude = left.abs() @ right.abs().t() + bias.double().abs()
    assert out.shape == exact.shape and out.dtype == out_dtype
    accumulation = (k + 4) * U if device == "cpu" else 2.0**-9
    rounding = U if out_dtype == torch.float32 else 2.0**-8
    return ((out.double() - exact).abs() - accumulation * magnitude - rounding * exact.abs()).max().item()


# E8M0 scale codes of A's rows and B's rows: 2^0, 2^-127 (code 0, an fp32 subnormal), 2^127 (B's
# 254: A's scale multiplies the block's sum first, so that this one must stay under 2^105, code
# 233), NaN (255), and codes whose products with the others are past fp32's ends: 2^-149 (0 and
# 105), 2^-154 (0 and 100, a block's value still an fp32 subnormal), 2^127 (232 and 149), 2^0
# (0 and 254).
EDGE_A_CODES = [127, 0, 232, 255, 140]
EDGE_B_CODES = [127, 105, 0, 254, 149, 100, 255]


def edge_scales_differ(device: str) -> int:
    """How many outputs of a GEMM whose only nonzero K block carries EDGE_*_CODES differ from
    the reference's (NaN equal to NaN): the block's sum is an integer (codes 1, 2 and 3; exact in
    any order of accumulation), so each output is one rounding of it times 2^(ea + eb - 254), as
    the float64 reference rounded to fp32 is, even where that power of two is past fp32's range
    (triton_grouped_fp8's contract). One operand rowwise, the other columnwise."""
    generator = torch.Generator().manual_seed(1)
    m, n, k = len(EDGE_A_CODES), len(EDGE_B_CODES), 64
    codes = [torch.randint(1, 4, (rows, k), generator=generator).float() for rows in (m, n)]
    codes[0][:, 32:] = 0  # the second K block adds 0 (its scale 2^0)
    codes[1][EDGE_B_CODES.index(254)] = 1  # a larger code times 2^127 is past fp32's range
    codes = [c.to(torch.float8_e4m3fn) for c in codes]
    scales = [torch.full((rows, k // 32), 127, dtype=torch.uint8) for rows in (m, n)]
    scales[0][:, 0], scales[1][:, 0] = torch.tensor(EDGE_A_CODES), torch.tensor(EDGE_B_CODES)
    quantizer = MXFP8Quantizer()
    a = quantizer.representation(ROWWISE, (m, k), torch.float32, codes[0].to(device), scales[0].t().contiguous().t().to(device))
    # B columnwise: its (k, n) tensor's codes as stored, its 32x1 blocks' scales (k / 32, n).
    b = quantizer.representation(COLUMNWISE, (k, n), torch.float32, codes[1].t().contiguous().to(device), scales[1].t().contiguous().to(device))
    out = backends.triton_mxfp8.gemm(a, b, torch.float32).cpu()
    values = [mxfp8.dequantize(c, s, axis=1).double() for c, s in zip(codes, scales)]
    expected = (values[0] @ values[1].t()).float()
    return int((~((out == expected) | (out.isnan() & expected.isnan()))).sum())


def _cases():
    return [(gemm, elements) for gemm in LAYOUTS for elements in ELEMENTS]


@pytest.fixture(scope="module")
def interpreted() -> dict:
    """Every case's excess, from one process running the kernel under Triton's interpreter."""
    pytest.importorskip("triton")
    return triton_interpreter.results_of(__file__)


@pytest.mark.parametrize("gemm,elements", _cases(), ids=[f"{g}-{e}" for g, e in _cases()])
def test_mxfp8_gemm_matches_float64_reference_interpreted(interpreted, gemm, elements):
    assert interpreted[f"{gemm} {elements}"] <= 0


def test_mxfp8_gemm_applies_e8m0_edge_scales_exactly_interpreted(interpreted):
    assert interpreted["edge scales"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", GPU_SHAPES)
@pytest.mark.parametrize("gemm,elements", _cases(), ids=[f"{g}-{e}" for g, e in _cases()])
def test_mxfp8_gemm_matches_float64_reference_on_gpu(gemm, elements, m, n, k):
    if backends.triton_mxfp8 is None:
        pytest.skip("needs Triton")
    assert excess(gemm, elements, m, n, k, torch.bfloat16, "cuda") <= 0


@pytest.mark.gpu
def test_mxfp8_gemm_applies_e8m0_edge_scales_exactly_on_gpu():
    if backends.triton_mxfp8 is None:
        pytest.skip("needs Triton")
    assert edge_scales_differ("cuda") == 0


@pytest.fixture
def hopper(monkeypatch):
    """backends.select on a CUDA device of capability 9.0 (faked), what it worked out forgotten around."""
    if backends.triton_mxfp8 is None:
        pytest.skip("no Triton: no MXFP8 GEMM on Hopper")
    monkeypatch.setattr(backends, "capability", lambda device: (9, 0))
    backends.clear_caches()
    yield backends.triton_mxfp8
    backends.clear_caches()


@pytest.mark.parametrize("gemm", LAYOUTS)
def test_planner_puts_every_mxfp8_gemm_past_the_decode_gemm_on_the_fp8_tensor_cores(hopper, gemm):
    """Any rows the decode GEMM does not take (its MXFP8 rows, operands stored with K last) up to
    the kernel's MAX_ROWS (where it bounds them; unknown rows then go elsewhere), either direction,
    E5M2 on either side, any sums the recipe allows: the FP8 tensor cores' GEMM, which promotes its
    sums (no fast accumulation); past MAX_ROWS the emulation."""
    (da, db), cuda = LAYOUTS[gemm], torch.device("cuda")
    decode_rows = backends.triton_decode.MAX_ROWS[("mxfp8", "mxfp8")]
    most = hopper.MAX_ROWS
    for qa, qb in ((MXFP8Quantizer(), MXFP8Quantizer()), (MXFP8Quantizer("e5m2"), MXFP8Quantizer())):
        for m in (decode_rows + 1, 2048, 16384, None):
            within = most is None or (m is not None and m <= most)
            expected = backends.GemmBackend(hopper.BACKEND if within else backends.EMULATION)
            for fast in (False, True):
                assert backends.select(qa, da, qb, db, cuda, (m, 4096, 4096), 1, fast).backend == expected, (m, fast)
    small = backends.select(MXFP8Quantizer(), da, MXFP8Quantizer(), db, cuda, (decode_rows, 4096, 4096)).backend.name
    assert small == (backends.triton_decode.BACKEND if gemm == "fprop" else hopper.BACKEND)
    batched = backends.select(MXFP8Quantizer(), da, MXFP8Quantizer(), db, cuda, (256, 4096, 4096), batch=2)
    assert batched.backend.name == backends.EMULATION


def test_mxfp8_gemm_names_what_it_cannot_take():
    """A K that MXFP8 cannot have (representations made by hand), or operands of different K."""
    pytest.importorskip("triton")
    quantizer = MXFP8Quantizer()
    a = quantizer.representation(ROWWISE, (4, 48), torch.float32, torch.zeros(4, 48, dtype=torch.float8_e4m3fn), torch.zeros(4, 2, dtype=torch.uint8))
    b = quantizer.representation(ROWWISE, (8, 64), torch.float32, torch.zeros(8, 64, dtype=torch.float8_e4m3fn), torch.zeros(8, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"k a multiple of 32; got \(4, 48\) by \(8, 64\)"):
        backends.triton_mxfp8.gemm(a, b, torch.float32)


if __name__ == "__main__":  # under TRITON_INTERPRET=1: every case's excess, as JSON
    triton_interpreter.accept_numpy_scalars()
    triton_interpreter.exact_fp8_dot_operands()
    results = {f"{gemm} {elements}": excess(gemm, elements, *INTERPRETED_SHAPE, torch.float32, "cpu") for gemm, elements in _cases()}
    results["edge scales"] = edge_scales_differ("cpu")
    print(json.dumps(results))
