"""NVFP4 reference numerics (spec 3.5 and 11) and NVFP4Quantizer.

Golden vectors are worked out by hand from the section 11 operation order; property tests bound
the round-trip error per block, and the random stream and Hadamard transform are checked against
scalar re-implementations of their documented formulas (what a CUDA kernel would copy).
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphquant.formats import nvfp4
from graphquant.quantizers import NVFP4Quantizer, QuantizeContext

NAN, INF = float("nan"), float("inf")
M32 = 0xFFFFFFFF
GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def f32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def spread(seed: int, shape: tuple[int, int], lo: int, hi: int) -> torch.Tensor:
    """Random finite fp32 values of both signs with binary exponents uniform in [lo, hi]."""
    g = torch.Generator().manual_seed(seed)
    exponent = torch.randint(lo, hi + 1, shape, generator=g).double()
    mantissa = 1 + torch.rand(shape, generator=g, dtype=torch.float64)
    sign = torch.randint(0, 2, shape, generator=g).double() * 2 - 1
    return (sign * mantissa * 2.0**exponent).float()


def codes_of(packed: torch.Tensor) -> list[list[int]]:
    return nvfp4.unpack(packed).tolist()


# -- E2M1 --------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "value, code",
    [(0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6)]  # ties to even
    + [(0.26, 1), (0.74, 1), (1.26, 3), (2.51, 5), (3.49, 5), (5.01, 7)]
    + [(6.0, 7), (7.0, 7), (1e30, 7), (INF, 7), (-INF, 15), (-5.0, 14), (-0.74, 9)]  # clamp to +-6
    + [(0.0, 0), (-0.0, 8), (-0.1, 8), (NAN, 7)],  # sign bit kept; NaN -> +6
)
def test_round_to_e2m1(value, code):
    assert nvfp4.round_to_e2m1(f32([value])).tolist() == [code]


def test_e2m1_values_and_grid_codes_round_trip():
    codes = torch.arange(16, dtype=torch.uint8)
    values = nvfp4.e2m1_values(codes)
    assert values.tolist() == list(GRID) + [-v for v in GRID]
    assert torch.signbit(values[8]).item()  # 0x8 is -0.0
    assert torch.equal(nvfp4.round_to_e2m1(values), codes)


def test_pack_order():
    """Column 2j in the low nibble, 2j+1 in the high one."""
    codes = torch.tensor([[0x1, 0x2, 0xF, 0x7], [0x0, 0x8, 0x9, 0x0]], dtype=torch.uint8)
    assert nvfp4.pack(codes).tolist() == [[0x21, 0x7F], [0x80, 0x09]]
    assert torch.equal(nvfp4.unpack(nvfp4.pack(codes)), codes)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 15), min_size=2, max_size=64).filter(lambda c: len(c) % 2 == 0))
def test_pack_unpack_round_trip(codes):
    t = torch.tensor([codes], dtype=torch.uint8)
    assert torch.equal(nvfp4.unpack(nvfp4.pack(t)), t)


# -- two-level scale: golden vectors -----------------------------------------------------------

def test_two_level_scale_golden():
    """One row, four 16-element blocks; global amax 2688 so S_enc = 2688 / 2688 = 1 = S_dec.

    block 0, amax 2688: s = 2688 * fp32(1/6) = 448.0000134 -> clamp 448 (E4M3 0x7E);
        encode = 1 / 448 -> fp32(1/448): 2688 -> 6 (0x7), -448 -> -1 (0xA).
    block 1, amax 96: s = 96 * fp32(1/6) = 16.0000005 -> fp32 16 exactly (0x58); encode 1/16:
        x / 16 hits every tie: -40 -> -2.5 -> -2 (0xC), 20 -> 1.25 -> 1 (0x2), 4 -> 0.25 -> 0,
        -56 -> -3.5 -> -4 (0xE), 80 -> 5 -> 4 (0x6), 12 -> 0.75 -> 1, 28 -> 1.75 -> 2 (0x4).
    block 2, all zero: s = 0, encode = min(1 / 0, FLT_MAX) = FLT_MAX, codes 0.
    block 3, amax 0.03: s = 0.005 -> E4M3 subnormal 3 * 2^-9 (0x03); encode = 512 / 3:
        0.03 -> 5.12 -> 6 (0x7), -0.01 -> -1.71 -> -1.5 (0xB), 0.003 -> 0.512 -> 0.5 (0x1).
    """
    x = torch.zeros(1, 64)
    x[0, 0:2] = f32([2688.0, -448.0])
    x[0, 16:32] = f32([96, -40, 20, 8, 4, -56, 80, 12, 28, 48, 64, 24, 0, -8, 16, 2])
    x[0, 48:51] = f32([0.03, -0.01, 0.003])
    packed, scales, amax = nvfp4.quantize(x, tile_rows=1, row_scaled=False, rng=None)
    assert amax.shape == () and amax.item() == 2688.0
    assert scales.dtype == torch.float8_e4m3fn
    assert scales.view(torch.uint8).tolist() == [[0x7E, 0x58, 0x00, 0x03]]
    expected = [0x7, 0xA] + [0] * 14
    expected += [0x7, 0xC, 0x2, 0x1, 0x0, 0xE, 0x6, 0x2, 0x4, 0x5, 0x6, 0x3, 0x0, 0x9, 0x2, 0x0]
    expected += [0] * 16 + [0x7, 0xB, 0x1] + [0] * 13
    assert codes_of(packed) == [expected]
    assert packed[0, :1].tolist() == [0xA7] and packed[0, 8:10].tolist() == [0xC7, 0x12]
    deq = nvfp4.dequantize(packed, scales, amax)[0]
    assert deq[:2].tolist() == [2688.0, -448.0]
    assert deq[16:20].tolist() == [96.0, -32.0, 16.0, 8.0]
    assert deq[48:51].tolist() == [6 * 3 * 2.0**-9, -1.5 * 3 * 2.0**-9, 0.5 * 3 * 2.0**-9]


def test_fp32_one_sixth_constant():
    """Section 11 folds fp32(1/6) into the multiplier; the constant a kernel must use."""
    assert f32(1 / 6).view(torch.int32).item() == 0x3E2AAAAB


def test_zero_tensor():
    packed, scales, amax = nvfp4.quantize(torch.zeros(2, 32), tile_rows=1, row_scaled=False, rng=None)
    assert amax.item() == 0.0  # S_enc = 1
    assert scales.float().abs().max().item() == 0.0 and packed.max().item() == 0
    assert nvfp4.dequantize(packed, scales, amax).abs().max().item() == 0.0


def test_inf_and_nan():
    """amax = inf: S_enc = 2688 / inf = 0 -> 1, so codes and scales stay finite and meaningful;
    dequantize applies amax / 2688 = inf as TE's GEMM alpha would (inf, and NaN for 0 codes).
    A NaN makes amax NaN: every scale is NaN (E4M3 0x7F) and every code the NaN code 0x7."""
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1], x[0, 16] = INF, 1.0, 3.0
    packed, scales, amax = nvfp4.quantize(x, tile_rows=1, row_scaled=False, rng=None)
    assert amax.item() == INF
    # block 0: s = min(inf) clamped to 448, encode fp32(1/448): inf -> 6, 1 -> 0.0022 -> 0.
    # block 1: s = 3 * fp32(1/6) -> 0.5, encode 2: 3 -> 6.
    assert scales.float().tolist() == [[448.0, 0.5]]
    assert codes_of(packed)[0][:2] == [0x7, 0x0] and codes_of(packed)[0][16] == 0x7
    deq = nvfp4.dequantize(packed, scales, amax)[0]
    assert deq[0].item() == INF and deq[1].isnan()

    x[0, 0] = NAN
    packed, scales, amax = nvfp4.quantize(x, tile_rows=1, row_scaled=False, rng=None)
    assert amax.isnan() and scales.view(torch.uint8).tolist() == [[0x7F, 0x7F]]
    assert set(sum(codes_of(packed), [])) == {0x7}
    assert nvfp4.dequantize(packed, scales, amax).isnan().all()


def test_2d_tiles_share_the_scale_within_16_rows():
    """20 x 32: tiles are rows 0-15 and the partial tile 16-19; every row of a tile gets the tile
    amax's scale, stored per (row, block)."""
    x = torch.ones(20, 32)
    x[3, 5] = 96.0  # tile (0, 0)
    x[18, 20] = 48.0  # partial tile (1, 1)
    packed, scales, _ = nvfp4.quantize(x, tile_rows=16, row_scaled=False, rng=None)
    s = scales.float()
    assert s.shape == (20, 2)
    assert (s[:16, 0] == s[3, 0]).all() and (s[:16, 1] == s[0, 1]).all()
    assert (s[16:, 0] == s[16, 0]).all() and (s[16:, 1] == s[18, 1]).all()
    assert s[3, 0] == 448.0 and s[18, 1] > s[16, 0]  # 96 = global amax maps to 448
    _, scales_1d, _ = nvfp4.quantize(x, tile_rows=1, row_scaled=False, rng=None)
    assert (scales_1d.float()[:16, 0] != s[3, 0]).sum() == 15  # 1D: only row 3 sees the 96


def test_row_scaled_uses_per_row_amax():
    """Each row is encoded as if it were a tensor of its own."""
    x = spread(0, (4, 32), -3, 3) * f32([1.0, 1e-3, 1e4, 7.0])[:, None]
    packed, scales, amax = nvfp4.quantize(x, tile_rows=1, row_scaled=True, rng=None)
    assert amax.shape == (4,) and torch.equal(amax, x.abs().amax(1))
    for r in range(4):
        p, s, a = nvfp4.quantize(x[r : r + 1], tile_rows=1, row_scaled=False, rng=None)
        assert torch.equal(packed[r : r + 1], p)
        assert torch.equal(scales[r : r + 1].view(torch.uint8), s.view(torch.uint8))
        assert a.item() == amax[r].item()
    deq = nvfp4.dequantize(packed, scales, amax)
    for r in range(4):
        single = nvfp4.quantize(x[r : r + 1], tile_rows=1, row_scaled=False, rng=None)
        assert torch.equal(deq[r : r + 1], nvfp4.dequantize(*single))


def test_tile_rows_must_be_1_or_16():
    with pytest.raises(ValueError, match="tile_rows"):
        nvfp4.quantize(torch.ones(16, 16), tile_rows=8, row_scaled=False, rng=None)


# -- round-trip error bound --------------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    lo=st.integers(-40, 20),
    width=st.integers(0, 24),
    tile_rows=st.sampled_from([1, 16]),
    row_scaled=st.booleans(),
    stochastic=st.booleans(),
)
def test_roundtrip_error_bound(seed, lo, width, tile_rows, row_scaled, stochastic):
    """Per element, with d = s * amax / 2688 the decoded block scale and vm the block (tile) amax:

        |x^ - x| <= max(g * d, vm - 6 d) + 2^-20 (vm + 6 d)

    y = x / d is what gets rounded. If |y| <= 6, RNE moves it by at most half the largest E2M1
    gap (g = 1; stochastic rounding: less than a whole gap, g = 2), i.e. g * d in x. If the E4M3
    scale rounded down, |y| can exceed 6 and is clamped: the error is |x| - 6 d <= vm - 6 d
    (for a normal s this is <= vm / 16 < d; for a subnormal or zero s it dominates: s = 0 gives
    x^ = 0 and error |x| <= vm). The last term covers the fp32 steps (S_enc, S_dec, encode, the
    product, amax / 2688, the final multiply): a few roundings of 2^-24 relative each.
    """
    rows, cols = 20, 64
    x = spread(seed, (rows, cols), lo, lo + width)
    rng = (seed, 7, 1) if stochastic else None
    packed, scales, amax = nvfp4.quantize(x, tile_rows=tile_rows, row_scaled=row_scaled, rng=rng)
    deq = nvfp4.dequantize(packed, scales, amax).double()
    a = amax.double()[:, None] if row_scaled else amax.double()
    d = (scales.double() * a / 2688.0).repeat_interleave(16, dim=1)
    vm = nvfp4._tile_amax(x.double().abs(), tile_rows).repeat_interleave(16, dim=1)
    g = 2.0 if stochastic else 1.0
    bound = torch.maximum(g * d, vm - 6 * d) + 2.0**-20 * (vm + 6 * d)
    assert ((deq - x.double()).abs() <= bound).all()


# -- random bits and stochastic rounding -------------------------------------------------------

def _fmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def _random_word(seed: int, offset: int, stream: int, i: int) -> int:
    """The documented formula, scalar, with Python's exact integers."""
    key = 0x6A09E667
    for w in (seed & M32, seed >> 32, offset & M32, offset >> 32, stream):
        key = _fmix32(key ^ w)
    return _fmix32((_fmix32(key ^ (i >> 32)) + (i & M32) * 0x9E3779B9) & M32)


@pytest.mark.parametrize("seed, offset, stream", [(0, 0, 0), (1234, 5, 1), (2**63 - 1, 2**40 + 3, 0)])
def test_random_bits_match_the_documented_formula(seed, offset, stream):
    bits = nvfp4.random_bits(seed, offset, stream, (3, 7))
    assert bits.dtype == torch.int64
    assert bits.flatten().tolist() == [_random_word(seed, offset, stream, i) for i in range(21)]


def test_random_bits_golden():
    """Fixed values for CUDA authors to check against."""
    assert nvfp4.random_bits(0, 0, 0, (4,)).tolist() == [701010857, 559035736, 3791446044, 2700256696]
    assert nvfp4.random_bits(1234, 5, 1, (3,)).tolist() == [4056385155, 453933942, 1801417365]


def test_random_bits_streams_differ_and_look_uniform():
    base = nvfp4.random_bits(1, 2, 0, (64, 64))
    assert torch.equal(base, nvfp4.random_bits(1, 2, 0, (64, 64)))
    for other in [(2, 2, 0), (1, 3, 0), (1, 2, 1)]:
        assert (nvfp4.random_bits(*other, (64, 64)) == base).float().mean() < 0.01
    assert ((base >= 0) & (base <= M32)).all()
    ones = torch.stack([(base >> b) & 1 for b in range(32)]).flatten(1).double().mean(1)
    assert ((ones - 0.5).abs() < 4 * 0.5 / 64).all()  # 4 standard errors over 4096 draws


@pytest.mark.parametrize("value", [0.1, 0.3, 1.2, 1.9, 2.3, 3.75, 4.9, 5.5, -2.7])
def test_stochastic_rounding_is_unbiased(value):
    n = 40000
    rand = nvfp4.random_bits(99, 0, 0, (n,))
    decoded = nvfp4.e2m1_values(nvfp4.round_to_e2m1(torch.full((n,), value), rand)).double()
    lo = max(g for g in GRID if g <= abs(value))
    hi = min(g for g in GRID if g > abs(value))
    assert set(decoded.abs().unique().tolist()) == {lo, hi}
    p = (abs(value) - lo) / (hi - lo)
    standard_error = (hi - lo) * (p * (1 - p) / n) ** 0.5
    assert abs(decoded.mean().item() - f32(value).item()) < 4 * standard_error


def test_stochastic_rounding_never_moves_grid_values():
    values = nvfp4.e2m1_values(torch.arange(16, dtype=torch.uint8)).repeat(1000)
    rand = nvfp4.random_bits(5, 6, 0, values.shape)
    assert torch.equal(nvfp4.round_to_e2m1(values, rand), torch.arange(16, dtype=torch.uint8).repeat(1000))


def test_stochastic_rounding_threshold():
    """Round up iff u * gap < a - lo, u = (rand >> 8) * 2^-24: strict, so u = 0 rounds anything
    above lo up and the largest u (1 - 2^-24) rounds even the last fp32 below hi down."""
    v = f32([2.0 + 2.0**-20, 3.0 - 2.0**-22, 2.5, 2.5])
    half = 2**23 << 8  # u = 0.5
    rand = torch.tensor([0, M32, half, half - 256 + 255])  # low 8 bits are ignored
    assert nvfp4.round_to_e2m1(v, rand).tolist() == [5, 4, 4, 5]


def test_stochastic_quantize_is_reproducible():
    x = spread(1, (32, 64), -4, 4)
    a = nvfp4.quantize(x, tile_rows=1, row_scaled=False, rng=(3, 4, 0))
    b = nvfp4.quantize(x, tile_rows=1, row_scaled=False, rng=(3, 4, 0))
    c = nvfp4.quantize(x, tile_rows=1, row_scaled=False, rng=(4, 4, 0))
    assert torch.equal(a[0], b[0])
    assert not torch.equal(a[0], c[0])
    assert torch.equal(a[1].view(torch.uint8), c[1].view(torch.uint8))  # scales do not depend on rng


# -- Hadamard transform ------------------------------------------------------------------------

def _hadamard_scalar(chunk: list[float], signs: bool) -> list[float]:
    """The documented butterfly on fp32 scalars, in place, stage by stage."""
    y = [torch.tensor(v, dtype=torch.float32) for v in chunk]
    if signs:
        y = [v * s for v, s in zip(y, nvfp4.RHT_SIGNS)]
    for h in (1, 2, 4, 8):
        for j in range(16):
            if j & h == 0:
                y[j], y[j + h] = y[j] + y[j + h], y[j] - y[j + h]
    return [(v * 0.25).item() for v in y]


@pytest.mark.parametrize("signs", [False, True])
def test_hadamard_matches_the_scalar_butterfly_bitwise(signs):
    x = spread(2, (3, 32), -10, 10)
    out = nvfp4.hadamard_transform(x, random_sign_mask=signs)
    expected = [sum((_hadamard_scalar(row[c : c + 16], signs) for c in (0, 16)), []) for row in x.tolist()]
    assert torch.equal(out, f32(expected))


def test_hadamard_is_the_signed_sylvester_matrix():
    idx = torch.arange(16)
    popcount = sum(((idx[:, None] & idx[None, :]) >> b) & 1 for b in range(4))
    h16 = (1 - 2 * (popcount % 2)).double()
    d = torch.diag(torch.tensor(nvfp4.RHT_SIGNS, dtype=torch.float64))
    x = spread(3, (5, 16), -3, 3)
    for signs, matrix in ((False, h16 / 4), (True, h16 @ d / 4)):
        expected = x.double() @ matrix.t()
        out = nvfp4.hadamard_transform(x, random_sign_mask=signs).double()
        assert torch.allclose(out, expected, rtol=0, atol=1e-5 * x.abs().max().item())


def test_the_random_sign_mask_is_transformer_engines():
    """TE's wgrad sign vector flips elements 3, 5-10, 12, 14 and 15 of each chunk: a chunk of ones
    at 0 and 7 becomes e0 - e7, which the Sylvester matrix sends to 1/2 where popcount(i & 7) is
    odd. graphquant's own mask had kept element 7 (and flipped 13 instead of 7, 9, 10 and 14), so
    its columnwise codes were not TE's."""
    chunk = torch.zeros(1, 16)
    chunk[0, 0] = chunk[0, 7] = 1.0
    odd = [bin(i & 7).count("1") % 2 for i in range(16)]
    assert nvfp4.hadamard_transform(chunk, random_sign_mask=True).tolist() == [[0.5 * o for o in odd]]


def _signed_sylvester(signs: bool) -> torch.Tensor:
    idx = torch.arange(16)
    popcount = sum(((idx[:, None] & idx[None, :]) >> b) & 1 for b in range(4))
    h16 = (1 - 2 * (popcount % 2)).double()
    return h16 @ torch.diag(torch.tensor(nvfp4.RHT_SIGNS, dtype=torch.float64)) if signs else h16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("signs", [False, True])
def test_hadamard_of_half_precision_input_is_rounded_to_its_dtype(dtype, signs):
    """TE transforms bf16 x by a bf16 matmul (its reference) or rounds its fp32 products to bf16
    before any amax or cast (its fused kernels): the values that get codes are the transform
    rounded to x's dtype, here the exact one rounded once (0.5-1% of codes moved when graphquant
    kept them in fp32)."""
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(5)).to(dtype)
    exact = (x.double().reshape(-1, 16) @ _signed_sylvester(signs).t() / 4).reshape(x.shape)
    out = nvfp4.hadamard_transform(x, random_sign_mask=signs)
    assert out.dtype == torch.float32
    assert torch.equal(out, exact.to(dtype).float())
    assert not torch.equal(out, nvfp4.hadamard_transform(x.float(), random_sign_mask=signs))


def test_hadamard_of_float64_input_is_its_float32_transform():
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    assert torch.equal(nvfp4.hadamard_transform(x, random_sign_mask=True), nvfp4.hadamard_transform(x.float(), random_sign_mask=True))


@pytest.mark.slow
def test_hadamard_of_bf16_input_rounds_the_same_compiled():
    """Inductor keeps a ``.to(bf16)`` fused into the kernel that reads it unrounded (so did the
    transform spelled that way here); the transform spells its rounding out."""
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(6)).bfloat16()

    def transformed_and_read(t):
        return nvfp4.hadamard_transform(t, random_sign_mask=True) * 1.0001

    compiled = torch.compile(transformed_and_read, backend="inductor", fullgraph=True)
    assert torch.equal(compiled(x), transformed_and_read(x))


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31), signs=st.booleans())
def test_hadamard_on_both_operands_preserves_the_product(seed, signs):
    """(dY^T Q)(X^T Q)^T = dY^T X for the orthogonal Q; equal to fp32 accuracy."""
    dyt, xt = spread(seed, (8, 64), -2, 2), spread(seed + 1, (12, 64), -2, 2)
    a = nvfp4.hadamard_transform(dyt, random_sign_mask=signs).double()
    b = nvfp4.hadamard_transform(xt, random_sign_mask=signs).double()
    ref = dyt.double() @ xt.double().t()
    scale = dyt.double().abs() @ xt.double().abs().t()
    assert ((a @ b.t() - ref).abs() <= 2.0**-20 * scale * 16).all()


# -- quantizer ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantizer_layouts_and_dtypes(dtype):
    x = spread(4, (48, 64), -3, 3).to(dtype)
    q = NVFP4Quantizer()(x)
    row, col = q.rowwise, q.columnwise
    assert row.data.shape == (48, 32) and row.scale.shape == (48, 4) and not row.transposed
    assert col.data.shape == (64, 24) and col.scale.shape == (64, 3) and col.transposed
    assert row.amax.shape == col.amax.shape == ()
    for rep, source in ((row, x.float()), (col, x.float().t())):
        packed, scales, amax = nvfp4.quantize(source, tile_rows=1, row_scaled=False, rng=None)
        assert torch.equal(rep.data, packed) and torch.equal(rep.scale.view(torch.uint8), scales.view(torch.uint8))
        assert torch.equal(rep.amax, amax)
        assert rep.dequantize().dtype == dtype
    assert q.dequantize(torch.float32).shape == (48, 64)


def test_quantizer_2d_columnwise_codes_are_the_transposed_rowwise_codes():
    x = spread(5, (48, 64), -6, 6)
    q = NVFP4Quantizer(with_2d_quantization=True)(x)
    row_codes = nvfp4.unpack(q.rowwise.data)
    col_codes = nvfp4.unpack(q.columnwise.data)
    assert torch.equal(col_codes, row_codes.t())
    assert torch.equal(q.columnwise.dequantize(torch.float32), q.rowwise.dequantize(torch.float32).t())
    q1 = NVFP4Quantizer()(x)  # 1D: the two directions are different numbers
    assert not torch.equal(nvfp4.unpack(q1.columnwise.data), nvfp4.unpack(q1.rowwise.data).t())


def test_quantizer_row_scaled_only_on_rowwise():
    x = spread(6, (32, 32), -3, 3)
    q = NVFP4Quantizer(row_scaled_nvfp4=True)(x)
    assert q.rowwise.amax.shape == (32,) and q.columnwise.amax.shape == ()


def test_quantizer_stochastic_rounding_uses_the_context_stream():
    x = spread(7, (32, 32), -3, 3)
    quantizer = NVFP4Quantizer(stochastic_rounding=True)
    a = quantizer(x, ctx=QuantizeContext(seed=1, offset=2))
    b = quantizer(x, ctx=QuantizeContext(seed=1, offset=2))
    c = quantizer(x, ctx=QuantizeContext(seed=1, offset=3))
    assert torch.equal(a.rowwise.data, b.rowwise.data) and torch.equal(a.columnwise.data, b.columnwise.data)
    assert not torch.equal(a.rowwise.data, c.rowwise.data)
    expected, _, _ = nvfp4.quantize(x.t(), tile_rows=1, row_scaled=False, rng=(1, 2, 1))  # columnwise: stream 1
    assert torch.equal(a.columnwise.data, expected)


def test_quantizer_rht_wgrad():
    """With RHT on both columnwise operands the wgrad GEMM of the dequantized operands estimates
    dY^T X: its relative error is that of the two operands' quantization combined (errors are
    independent, so about sqrt(e_dy^2 + e_x^2)); with RHT on only one operand it is garbage."""
    g = torch.Generator().manual_seed(0)
    dy, x = torch.randn(256, 64, generator=g), torch.randn(256, 48, generator=g)
    quantizer = NVFP4Quantizer(with_rht=True, with_post_rht_amax=True)
    a = quantizer(dy, rowwise=False).columnwise
    b = quantizer(x, rowwise=False).columnwise
    assert a.hadamard and b.hadamard and a.transposed
    assert not quantizer(dy, columnwise=False).rowwise.hadamard
    ref = dy.double().t() @ x.double()

    def relative(approx, exact):
        return ((approx - exact).norm() / exact.norm()).item()

    a_op, b_op = a.gemm_operand(torch.float64), b.gemm_operand(torch.float64)
    e_dy = relative(a_op, nvfp4.hadamard_transform(dy.t(), random_sign_mask=True).double())
    e_x = relative(b_op, nvfp4.hadamard_transform(x.t(), random_sign_mask=True).double())
    wgrad_error = relative(a_op @ b_op.t(), ref)
    assert wgrad_error < 1.25 * (e_dy**2 + e_x**2) ** 0.5 < 0.25
    plain_b = NVFP4Quantizer()(x, rowwise=False).columnwise.gemm_operand(torch.float64)
    assert relative(a_op @ plain_b.t(), ref) > 0.9


@pytest.mark.parametrize("tiles", [False, True])
@pytest.mark.parametrize("shape, direction, dim", [((32, 24), "rowwise", 1), ((24, 32), "columnwise", 0)])
def test_quantizer_shape_errors(shape, direction, dim, tiles):
    """The dim a GEMM sums over holds whole blocks, 16x16 tiles' too (whose message said they were
    16-element blocks along that dim); a tile may end short along the other dim."""
    blocks = "16x16" if tiles else ("1x16" if direction == "rowwise" else "16x1")
    quantizer = NVFP4Quantizer(with_2d_quantization=tiles)
    with pytest.raises(ValueError, match=rf"{blocks} blocks, 16 elements along dim {dim}, which a GEMM sums over, so dim {dim} of the {shape[0]}x{shape[1]} tensor must be a multiple of 16 \(got 24\)"):
        quantizer(torch.zeros(shape), rowwise=direction == "rowwise", columnwise=direction == "columnwise")
    short = shape[::-1]  # the other dim 24: the summed dim whole
    quantizer(torch.zeros(short), rowwise=direction == "rowwise", columnwise=direction == "columnwise")
