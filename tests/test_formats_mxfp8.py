"""MXFP8 reference numerics (spec 3.4) and MXFP8Quantizer.

Golden vectors are worked out by hand; property tests bound the round-trip error, check that the
E8M0 scale is the smallest power of two that avoids clipping, and check idempotence.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphquant.formats import fp8, mxfp8
from graphquant.quantizers import MXFP8Quantizer

NAN, INF = float("nan"), float("inf")
FORMATS = ["e4m3", "e5m2"]
MANTISSA_BITS = {"e4m3": 3, "e5m2": 2}
MIN_NORMAL_EXP = {"e4m3": -6, "e5m2": -14}


def f32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.equal(actual.view(torch.uint8), expected.view(torch.uint8)), (actual, expected)


def spread(seed: int, shape: tuple[int, int], lo: int, hi: int) -> torch.Tensor:
    """Random finite fp32 values of both signs with binary exponents uniform in [lo, hi]."""
    g = torch.Generator().manual_seed(seed)
    exponent = torch.randint(lo, hi + 1, shape, generator=g).double()
    mantissa = 1 + torch.rand(shape, generator=g, dtype=torch.float64)
    sign = torch.randint(0, 2, shape, generator=g).double() * 2 - 1
    return (sign * mantissa * 2.0**exponent).float()


# -- E8M0 --------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "amax, biased",
    [
        (448.0, 127),  # v = 1 exactly: a power of two stays
        (449.0, 128),  # v just above 1 rounds up to 2
        (224.0, 126),
        (0.0, 0),
        (448.0 * 2.0**-127, 0),  # v = 2^-127 (an fp32 subnormal) is the smallest E8M0 value
        (448.0 * 2.0**-128, 0),  # below 2^-127: nothing smaller to round to
        (448.0 * 1.5 * 2.0**-127, 1),  # 2^-127 < v < 2^-126 rounds up to 2^-126
        (448.0 * 2.0**-126, 1),
        (torch.finfo(torch.float32).max, 247),  # v ~ 2^119.2 -> 2^120: finite amax never saturates
        (INF, 254),  # saturates to the largest finite E8M0 value, 2^127
        (NAN, 255),
    ],
)
def test_e8m0_golden_e4m3(amax, biased):
    assert mxfp8.e8m0_from_amax(f32([amax]), "e4m3").tolist() == [biased]


def test_e8m0_golden_e5m2():
    assert mxfp8.e8m0_from_amax(f32([57344.0, 57345.0, 1.0]), "e5m2").tolist() == [127, 128, 112]


@pytest.mark.parametrize("fmt", FORMATS)
def test_e8m0_matches_ceil_log2_on_random_bit_patterns(fmt):
    """Every finite non-negative fp32 amax: biased = clamp(ceil(log2(fp32(amax / max))) + 127, 0, 254)."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 0x7F800000, (20000,), generator=g, dtype=torch.int64).to(torch.int32)
    amax = bits.view(torch.float32)
    v = (amax / torch.full_like(amax, fp8.fp8_max(fmt))).tolist()
    expected = [0 if x == 0 else min(max(math.ceil(math.log2(x)) + 127, 0), 254) for x in v]
    assert mxfp8.e8m0_from_amax(amax, fmt).tolist() == expected


def test_scale_bits_are_exact():
    biased = torch.tensor([0, 1, 127, 253, 254, 255], dtype=torch.uint8)
    enc = mxfp8.encode_multiplier(biased).tolist()
    assert enc[:5] == [1.0, 2.0**126, 1.0, 2.0**-126, 2.0**-127] and math.isnan(enc[5])
    dec = mxfp8.decode_scale(biased).tolist()
    assert dec[:5] == [2.0**-127, 2.0**-126, 1.0, 2.0**126, 2.0**127] and math.isnan(dec[5])


# -- quantize / dequantize golden vectors ------------------------------------------------------

def test_quantize_golden_block():
    """amax 449 -> scale 2: elements are x / 2 rounded to E4M3; one 1x32 block."""
    x = torch.zeros(1, 32)
    x[0, :4] = f32([449.0, -3.0, 0.3, 100.0])
    data, scales = mxfp8.quantize(x, "e4m3", axis=1)
    assert scales.tolist() == [[128]]
    # 224.5 -> 224 (E4M3 step 16 in [128, 256)), -1.5 exact, 0.15 -> 0.15625 (step 2^-6),
    # 50 -> 48 (step 4 in [32, 64): a tie between 48 and 52, to the even mantissa)
    expected = torch.zeros(1, 32)
    expected[0, :4] = f32([224.0, -1.5, 0.15625, 48.0])
    assert_same_bits(data, expected.to(torch.float8_e4m3fn))
    assert mxfp8.dequantize(data, scales, axis=1)[0, :4].tolist() == [448.0, -3.0, 0.3125, 96.0]


def test_zero_block_gives_zero_data_and_scale_zero():
    x = torch.zeros(2, 64)
    x[1, 40] = 1.0
    data, scales = mxfp8.quantize(x, "e4m3", axis=1)
    assert scales.tolist() == [[0, 0], [0, 119]]  # 1/448 -> 2^-8
    assert torch.equal(data.view(torch.uint8)[0], torch.zeros(64, dtype=torch.uint8))
    assert mxfp8.dequantize(data, scales, axis=1)[0].abs().max().item() == 0.0


def test_tiny_block_flushes_to_zero():
    """biased 0 encodes with multiplier 1 (TE), so a block with amax <= 448 * 2^-127 becomes 0."""
    x = torch.full((1, 32), 448.0 * 2.0**-128)
    data, scales = mxfp8.quantize(x, "e4m3", axis=1)
    assert scales.tolist() == [[0]] and data.float().abs().max().item() == 0.0


def test_inf_and_nan_blocks():
    x = torch.ones(1, 96)
    x[0, 3] = INF
    x[0, 4] = -INF
    x[0, 40] = NAN
    data, scales = mxfp8.quantize(x, "e4m3", axis=1)
    assert scales.tolist() == [[254, 255, 119]]
    values = data.float()[0]
    # inf block: scale 2^127; +-inf saturate to +-448, the ones (1 * 2^-127) round to 0.
    assert values[3].item() == 448.0 and values[4].item() == -448.0
    assert values[:3].abs().max().item() == 0.0
    assert values[32:64].isnan().all()  # NaN block: NaN multiplier
    assert values[64:].tolist() == [256.0] * 32  # other blocks untouched (scale 2^-8)
    deq = mxfp8.dequantize(data, scales, axis=1)[0]
    assert deq[3].item() == INF and deq[4].item() == -INF  # 448 * 2^127 overflows fp32
    assert deq[32:64].isnan().all() and deq[64:].tolist() == [1.0] * 32


def test_columnwise_blocks_run_down_columns():
    x = torch.ones(64, 2)
    x[40, 1] = 449.0
    data, scales = mxfp8.quantize(x, "e4m3", axis=0)
    assert data.shape == (64, 2) and scales.shape == (2, 2)
    assert scales.tolist() == [[119, 119], [119, 128]]  # amax 1: 1/448 rounds up to 2^-8
    assert data.float()[40, 1].item() == 224.0 and data.float()[33, 1].item() == 0.5


# -- properties --------------------------------------------------------------------------------

def _block_view(t: torch.Tensor, axis: int) -> torch.Tensor:
    m, k = t.shape
    return t.reshape(m, k // 32, 32) if axis == 1 else t.reshape(m // 32, 32, k).transpose(1, 2)


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    fmt=st.sampled_from(FORMATS),
    axis=st.sampled_from([0, 1]),
    lo=st.integers(-100, 0),
    width=st.integers(0, 40),
    ties=st.booleans(),
)
def test_roundtrip_error_bound(seed, fmt, axis, lo, width, ties):
    """|x^ - x| <= 2^-(m+1) * max(|x|, 2^emin * S), S = 2^(biased - 127) the block's decode scale.

    The scale is rounded up, so y = x / S satisfies |y| <= fp8_max and nothing clips; x * 2^-e is
    exact, so the only error is the RNE cast of y: half an ulp, i.e. 2^-(m+1) |y| for normal y and
    half the subnormal step 2^(emin - m - 1) below 2^emin. Decoding multiplies back exactly.
    The scale is also tight: amax <= fp8_max * S < 2 * amax.
    """
    x = spread(seed, (64, 64), lo, lo + width)
    if ties:  # values with few mantissa bits land exactly on E4M3/E5M2 ties
        x = (x * 4).round() / 4
    data, scales = mxfp8.quantize(x, fmt, axis=axis)
    scale = mxfp8.decode_scale(scales).double()
    amax = _block_view(x.double().abs(), axis).amax(-1)
    nonzero = amax > 0
    limit = fp8.fp8_max(fmt)
    assert (amax <= limit * scale).all()
    assert (limit * scale < 2 * amax)[nonzero].all()
    err = _block_view((mxfp8.dequantize(data, scales, axis=axis).double() - x.double()).abs(), axis)
    floor = 2.0 ** MIN_NORMAL_EXP[fmt] * scale.unsqueeze(-1)
    bound = 2.0 ** -(MANTISSA_BITS[fmt] + 1) * torch.maximum(_block_view(x.double().abs(), axis), floor)
    assert (err <= bound).all()


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**31), fmt=st.sampled_from(FORMATS), axis=st.sampled_from([0, 1]), lo=st.integers(-60, 60))
def test_requantizing_dequantized_values(seed, fmt, axis, lo):
    """Re-quantizing x^ gives the same values always, and the same bits unless a block's largest
    code is exactly fp8_max / 2: then its amax / fp8_max is a power of two, the scale halves and
    the codes double (e.g. amax 225 * 2^e -> code 224 -> new scale 2^(e-1), codes 448)."""
    x = spread(seed, (64, 64), lo, lo + 12)
    data, scales = mxfp8.quantize(x, fmt, axis=axis)
    deq = mxfp8.dequantize(data, scales, axis=axis)
    data2, scales2 = mxfp8.quantize(deq, fmt, axis=axis)
    assert torch.equal(mxfp8.dequantize(data2, scales2, axis=axis), deq)
    code_max = _block_view(data.float().abs(), axis).amax(-1)
    stable = code_max != fp8.fp8_max(fmt) / 2
    assert torch.equal(scales2[stable], scales[stable])
    same = _block_view(data2.view(torch.uint8) == data.view(torch.uint8), axis).all(-1)
    assert same[stable].all()


def test_requantizing_a_half_max_block_halves_the_scale():
    x = torch.full((1, 32), 226.0)  # rounds to 224 = 448 / 2 at scale 1
    data, scales = mxfp8.quantize(x, "e4m3", axis=1)
    data2, scales2 = mxfp8.quantize(mxfp8.dequantize(data, scales, axis=1), "e4m3", axis=1)
    assert scales.tolist() == [[127]] and scales2.tolist() == [[126]]
    assert data.float()[0, 0].item() == 224.0 and data2.float()[0, 0].item() == 448.0


# -- quantizer ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantizer_directions(dtype, fmt):
    """Odd rows 2^20 times smaller: rowwise blocks see one row, columnwise blocks mix both, so the
    two directions get different scales and codes; both keep x's layout."""
    row_scale = torch.where(torch.arange(64) % 2 == 1, 2.0**-20, 1.0)[:, None]
    x = (spread(3, (64, 96), -2, 2) * row_scale).to(dtype)
    q = MXFP8Quantizer(fp8_dtype=fmt)(x)
    row, col = q.rowwise, q.columnwise
    assert row.data.shape == col.data.shape == (64, 96) and not row.transposed and not col.transposed
    assert row.scale.shape == (64, 3) and col.scale.shape == (2, 96)
    assert row.data.dtype == col.data.dtype == fp8.FP8_DTYPES[fmt]
    assert not torch.equal(row.data.view(torch.uint8), col.data.view(torch.uint8))
    # each direction is the format function applied to x.float(), bit for bit
    for rep, axis in ((row, 1), (col, 0)):
        data, scales = mxfp8.quantize(x.float(), fmt, axis=axis)
        assert_same_bits(rep.data, data)
        assert torch.equal(rep.scale, scales)
        assert rep.dequantize().dtype == dtype
    assert torch.equal(row.gemm_operand(torch.float32), mxfp8.dequantize(row.data, row.scale, axis=1))
    assert torch.equal(col.gemm_operand(torch.float32), mxfp8.dequantize(col.data, col.scale, axis=0).t())
    # columnwise = the rowwise encoding of x^T, transposed back into x's layout
    data_t, scales_t = mxfp8.quantize(x.float().t(), fmt, axis=1)
    assert_same_bits(col.data, data_t.t())
    assert torch.equal(col.scale, scales_t.t())


@pytest.mark.parametrize(
    "shape, direction, block, dim",
    [((64, 48), "rowwise", "1x32", 1), ((48, 64), "columnwise", "32x1", 0)],
)
def test_quantizer_shape_errors(shape, direction, block, dim):
    quantizer = MXFP8Quantizer()
    with pytest.raises(ValueError, match=rf"{block} blocks, so dim {dim} .*multiple of 32 \(got 48\)"):
        quantizer(torch.zeros(shape), rowwise=direction == "rowwise", columnwise=direction == "columnwise")
