"""NVFP4 reference numerics: E2M1 elements, an E4M3 scale per 16 elements, an fp32 global amax.

The encode path follows the operation order of TE's pure-PyTorch reference (spec section 11)
step for step. Every step is an exact operation, a comparison, or one IEEE fp32 operation with
round-to-nearest-even; divisions are tensor / tensor so no backend swaps them for a multiply by
a reciprocal. A kernel reproduces the bits if it does the same operations in the same order,
with IEEE division (no fast-math) and without flush-to-zero.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false, statically_known_true

from graphquant.formats import rounding
from graphquant.formats.fp8 import max_with_zero

BLOCK_LEN = 16

E4M3_MAX = 448.0
E2M1_MAX = 6.0
GLOBAL_DIVISOR = E4M3_MAX * E2M1_MAX  # the global decode factor is amax / GLOBAL_DIVISOR (global_decode)
FLT_MAX = torch.finfo(torch.float32).max

# E2M1 magnitudes by code (bits 0-2); bit 3 is the sign.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_NAN_CODE = 0x7  # E2M1 has no NaN: a NaN saturates to +6, like any out-of-range value.

# The fixed +-1 sign mask of the random Hadamard transform (element j of each 16-chunk): TE's
# (its get_wgrad_sign_vector), so that the transformed columnwise codes are TE's.
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
_HASH_IV = 0x6A09E667


def _const(value: float, like: torch.Tensor) -> torch.Tensor:
    """``value`` as an fp32 tensor shaped like ``like``: a tensor operand, so that ``c / t`` is one
    correctly rounded division (torch computes ``python_float / t`` as reciprocal(t) * c)."""
    return torch.full_like(like, value, dtype=torch.float32)


# -- E2M1 --------------------------------------------------------------------------------------

def round_to_e2m1(v: torch.Tensor, rand: Optional[torch.Tensor] = None) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) of fp32 ``v``: bit 3 = sign, bits 0-2 = magnitude index.

    |v| is clamped to 6. Without ``rand``: round to nearest, ties to the even code (= even
    mantissa): a = |v| gets index [a > 0.25] + [a >= 0.75] + [a > 1.25] + [a >= 1.75]
    + [a > 2.5] + [a >= 3.5] + [a > 5], so 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4.

    With ``rand`` (int64 in [0, 2^32), same shape): take lo = the largest grid value <= a and hi
    the next one; round up iff u * (hi - lo) < a - lo with u = (rand >> 8) * 2^-24. All three
    operations are exact in fp32: u is a 24-bit integer times a power of two; hi - lo is a power
    of two (0.5, 1 or 2); a - lo is exact by Sterbenz (lo <= a < hi <= 2 lo) or because lo = 0.
    So P(up) = ceil(2^24 (a - lo) / (hi - lo)) / 2^24, unbiased to 2^-24 of a gap, and grid
    values (a == lo) never move.

    Sign: the sign bit of v is kept, so -0.0 and small negatives that round to zero give 0x8
    (TE's Python reference gives 0x0 for -0.0 only; both decode to zero). NaN gives 0x7 (+6).
    """
    v = v.float()
    a = v.abs().clamp(max=E2M1_MAX)
    if rand is None:
        index = (
            (a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75)
            + (a > 2.5) + (a >= 3.5) + (a > 5.0)
        )
    else:
        grid = torch.tensor(E2M1_MAGNITUDES + (E2M1_MAX,), dtype=torch.float32, device=v.device)
        lo_index = sum((a >= g).to(torch.uint8) for g in E2M1_MAGNITUDES[1:])
        lo = grid[lo_index.long()]
        gap = grid[lo_index.long() + 1] - lo  # 0 at 6.0 (the top), so 6.0 never rounds up
        u = (rand >> 8).float() * 2.0**-24
        index = lo_index + (u * gap < a - lo)
    sign = (v.view(torch.int32) < 0).to(torch.uint8) << 3
    return torch.where(torch.isnan(v), E2M1_NAN_CODE, index.to(torch.uint8) | sign)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 value of each E2M1 code (0x8 decodes to -0.0)."""
    table = torch.tensor(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES), device=codes.device)
    return table[codes.long()]


def pack(codes: torch.Tensor) -> torch.Tensor:
    """(M, K) codes -> (M, K/2) bytes: column 2j in the low nibble, column 2j+1 in the high one."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack``: (M, K/2) bytes -> (M, K) codes."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], 2 * packed.shape[1])


# -- random bits -------------------------------------------------------------------------------

def _mul32(a, b: int):
    """(a * b) mod 2^32 for a in [0, 2^32), without int64 overflow (16-bit halves of b)."""
    return (a * (b & 0xFFFF) + (((a * (b >> 16)) & 0xFFFF) << 16)) & _M32


def _fmix32(h):
    """murmur3's 32-bit finalizer, on Python ints or int64 tensors holding uint32 values."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def random_bits(seed: int, offset: int, stream: int, shape: Sequence[int], device=None) -> torch.Tensor:
    """Counter-based uniform 32-bit words (int64 in [0, 2^32)) for a tensor of ``shape``: the
    words of ``random_bits_at`` for its row-major linear indices."""
    index = torch.arange(math.prod(shape), dtype=torch.int64, device=device)  # symbolic sizes stay symbolic
    return random_bits_at(seed, offset, stream, index).reshape(tuple(shape))


def random_bits_at(seed: int, offset: int, stream: int, index: torch.Tensor) -> torch.Tensor:
    """The counter-based uniform 32-bit words (int64 in [0, 2^32)) of the elements whose linear
    indices are ``index`` (int64), so that parts of a tensor can each draw as if alone.

    All arithmetic is on uint32 (mod 2^32); fmix32 is murmur3's finalizer:
        fmix32(h): h ^= h >> 16; h *= 0x85EBCA6B; h ^= h >> 13; h *= 0xC2B2AE35; h ^= h >> 16
    key = 0x6A09E667; for w in (seed_lo, seed_hi, offset_lo, offset_hi, stream):
        key = fmix32(key ^ w)            (seed, offset as 64-bit words split in 32-bit halves)
    For the element with linear index i (i_lo, i_hi its 32-bit halves):
        bits[i] = fmix32(fmix32(key ^ i_hi) + i_lo * 0x9E3779B9)
    i.e. splitmix32 (a Weyl sequence through fmix32) keyed by seed, offset, stream.
    """
    key = _HASH_IV
    for word in (seed & _M32, (seed >> 32) & _M32, offset & _M32, (offset >> 32) & _M32, stream & _M32):
        key = _fmix32(key ^ word)
    base = _fmix32(key ^ (index >> 32))
    return _fmix32((base + _mul32(index & _M32, _GOLDEN)) & _M32)


# -- random Hadamard transform -----------------------------------------------------------------

def hadamard_transform(x: torch.Tensor, *, random_sign_mask: bool) -> torch.Tensor:
    """(R, C) -> fp32 (R, C): each 16-element chunk of a row becomes (D H16 / 4)-transformed,
    rounded to x's dtype.

    Per chunk y (in fp32): if random_sign_mask, y[j] *= RHT_SIGNS[j] (exact). Then the Sylvester
    Walsh-Hadamard butterfly, stages h = 1, 2, 4, 8 in that order: for every j with
    (j & h) == 0: (y[j], y[j + h]) = (y[j] + y[j + h], y[j] - y[j + h]) in fp32. Then y *= 0.25
    (exact). So y_out[i] = 1/4 sum_j (-1)^popcount(i & j) s_j y[j]; the matrix is orthogonal,
    so transforming both wgrad operands leaves dY^T X unchanged. C must be a multiple of 16.

    Last, y is rounded to x's dtype (to nearest even; fp32 stays as it is): TE's reference is a
    matmul in x's dtype, and its fused kernels round their fp32 products to bf16 before the
    global amax, the block amax and the cast, so the codes are those of the rounded values.
    """
    rows, cols = x.shape
    y = x.float().reshape(rows, cols // BLOCK_LEN, BLOCK_LEN)
    if random_sign_mask:
        y = y * torch.tensor(RHT_SIGNS, dtype=torch.float32, device=x.device)
    for h in (1, 2, 4, 8):
        pairs = y.reshape(rows, cols // BLOCK_LEN, BLOCK_LEN // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(rows, cols // BLOCK_LEN, BLOCK_LEN)
    return rounding.rounded((y * 0.25).reshape(rows, cols), x.dtype)


# -- quantize / dequantize ---------------------------------------------------------------------

def _tile_amax(absx: torch.Tensor, tile_rows: int) -> torch.Tensor:
    """(R, C/16) block amax; with tile_rows=16, the max over each 16x16 tile, repeated per row."""
    rows, cols = absx.shape
    block_max = absx.reshape(rows, cols // BLOCK_LEN, BLOCK_LEN).amax(-1)
    if tile_rows == 1:
        return block_max
    if tile_rows != BLOCK_LEN:
        raise ValueError(f"NVFP4 tile_rows must be 1 or {BLOCK_LEN}, got {tile_rows}")
    padded_rows = -(-rows // BLOCK_LEN) * BLOCK_LEN
    padded = torch.nn.functional.pad(block_max, (0, 0, 0, padded_rows - rows))  # zeros: amax >= 0
    tiles = padded.reshape(padded_rows // BLOCK_LEN, BLOCK_LEN, block_max.shape[1]).amax(1)
    return tiles.repeat_interleave(BLOCK_LEN, dim=0)[:rows]


def global_amax(x: torch.Tensor, *, row_scaled: bool = False) -> torch.Tensor:
    """max |x| in fp32: 0-dim, or (R,) one per row when row_scaled; 0 where there is no value."""
    absx = x.float().abs()
    if guard_or_false(x.numel() == 0):
        return absx.new_zeros(x.shape[:1] if row_scaled else ())
    if row_scaled or statically_known_true(x.numel() != 0):
        return absx.amax(1) if row_scaled else absx.amax()
    return max_with_zero(absx)  # rows a data-dependent op chose, maybe none: 0 then


def quantize(
    x: torch.Tensor,
    *,
    tile_rows: int,
    row_scaled: bool,
    rng: Optional[tuple[int, int, int]],
    amax: Optional[torch.Tensor] = None,
    rng_index: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4-encode a 2-D tensor with 1x16 blocks along C (or 16x16 tiles when tile_rows=16).

    amax: the global amax to encode with (fp32, shaped as ``global_amax`` gives it), where it is
    not x's own: all-reduced over processes, it is at least x's, so the scales stay in range.
    rng_index: the counter (int64, x's shape) of each element's random word where it is not the
    row-major linear index, as when x holds parts that each draw as if alone.

    Returns (packed uint8 (R, C/2), scales float8_e4m3fn (R, C/16), global amax float32: 0-dim,
    or (R,) when row_scaled). Exactly TE's order (spec section 11), all fp32:
      vec_max = max |x| per block (per tile, shared by its rows); amax = max |x| (per row);
      S_enc = min(2688 / amax, FLT_MAX); S_enc = 1 where S_enc == 0 or amax == 0
        (amax = inf gives S_enc = 1; amax = NaN gives NaN scales: NaN poisons the tensor/row);
      S_dec = 1 / S_enc;  mult = S_enc * fp32(1/6);
      s = e4m3_RNE(clamp(vec_max * mult, -448, 448))  (the clamp subsumes min(., FLT_MAX));
      encode = min(1 / (fp32(s) * S_dec), FLT_MAX)    (zero block: s = 0, encode = FLT_MAX);
      q = round_to_e2m1(x * encode, rand), rand = random_bits(seed, offset, stream, (R, C)).
    """
    xf = x.float()
    rows, cols = xf.shape
    absx = xf.abs()
    vec_max = _tile_amax(absx, tile_rows)
    amax = global_amax(xf, row_scaled=row_scaled) if amax is None else amax
    s_enc = torch.minimum(torch.div(_const(GLOBAL_DIVISOR, amax), amax), _const(FLT_MAX, amax))
    s_enc = torch.where((s_enc == 0) | (amax == 0), _const(1.0, amax), s_enc)
    s_dec = torch.div(_const(1.0, s_enc), s_enc)
    mult = s_enc * _const(1.0 / 6.0, s_enc)  # fp32(1/6) = 0x3E2AAAAB
    if row_scaled:
        mult, s_dec = mult[:, None], s_dec[:, None]
    scales = (vec_max * mult).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    denom = scales.float() * s_dec
    encode = torch.minimum(torch.div(_const(1.0, denom), denom), _const(FLT_MAX, denom))
    scaled = (xf.reshape(rows, cols // BLOCK_LEN, BLOCK_LEN) * encode.unsqueeze(-1)).reshape(rows, cols)
    if rng is None:
        rand = None
    elif rng_index is None:
        rand = random_bits(*rng, (rows, cols), device=x.device)
    else:
        rand = random_bits_at(*rng, rng_index)
    codes = round_to_e2m1(scaled, rand)
    return pack(codes), scales, amax


def global_decode(amax: torch.Tensor) -> torch.Tensor:
    """The global decode factor amax / (448 * 6), one correctly rounded fp32 division (a divisor
    given as a Python float may become a multiply by its reciprocal on the GPU)."""
    amax = amax.float()
    return torch.div(amax, _const(GLOBAL_DIVISOR, amax))


def dequantize(packed: torch.Tensor, scales: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """float32 (R, C): (e2m1 * fp32(s)) * (amax / 2688), per block, amax per row if (R,).

    e2m1 * s is exact (2 + 4 significant bits); amax / 2688 is one fp32 division; the final
    multiply is the only other rounding. This mirrors TE's GEMM, which applies
    alpha = amax_a * amax_b / 2688^2 to sum(q * s); it may differ from q * s / S_enc in the last
    bit, and for amax = inf it gives inf/NaN where the encode side used S_enc = 1.
    """
    values = e2m1_values(unpack(packed))
    rows, cols = values.shape
    global_dec = global_decode(amax)
    if amax.dim() == 1:
        global_dec = global_dec[:, None, None]
    blocks = values.reshape(rows, cols // BLOCK_LEN, BLOCK_LEN) * scales.float().unsqueeze(-1)
    return (blocks * global_dec).reshape(rows, cols)
