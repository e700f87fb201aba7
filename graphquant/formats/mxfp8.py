"""MXFP8 reference numerics: FP8 elements, one E8M0 (power-of-two) scale per 32 elements.

TE rounds the block scale *up* to a power of two (``cvt.rp.satfinite.ue8m0``), so
``block_amax / scale <= fp8_max`` and no element clips; the OCP MX rule (floor) may clip.
Every step is exact or a single IEEE fp32 operation with round-to-nearest-even, so a kernel
reproduces the bits as long as it keeps fp32 subnormals (no flush-to-zero): 2^-127 is one.
"""

from __future__ import annotations

from typing import Callable

import torch

from graphquant.formats.fp8 import cast_to_fp8, fp8_max

BLOCK_LEN = 32

_NAN_BITS = 0x7FC00000
_ONE_BITS = 0x3F800000
_POW2_M127_BITS = 0x00400000  # 2^-127, an fp32 subnormal


def _bits_to_float(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def e8m0_scales(amax: torch.Tensor, fp8_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(e8m0_from_amax(amax), encode_multiplier of it) for blocks with this fp32 ``amax``. A
    quantize traced into a graph takes them from graphquant::e8m0_scales, the same numbers as one
    op (graphquant.ops.scales)."""
    biased = e8m0_from_amax(amax, fp8_dtype)
    return biased, encode_multiplier(biased)


def e8m0_from_amax(amax: torch.Tensor, fp8_dtype: str) -> torch.Tensor:
    """Biased E8M0 exponent (uint8) of the decode scale for blocks with this fp32 ``amax``.

    v = amax / fp8_max (one fp32 division, RNE), then v is rounded *up* to a power of two 2^e
    (powers of two stay) and encoded as e + 127, saturating to 254 (2^127, finite). From the
    fp32 bits of v (exponent field E, mantissa field m):
      normal (E >= 1):  E + (m != 0), capped at 254 (so +inf also gives 254);
      E == 0:           1 if m > 2^22 (2^-127 < v < 2^-126 rounds up to 2^-126), else 0
                        (v == 0 and every v <= 2^-127 give 2^-127, the smallest E8M0 value);
      NaN:              255.
    """
    divisor = torch.full_like(amax, fp8_max(fp8_dtype), dtype=torch.float32)
    v = torch.div(amax.float(), divisor)  # tensor / tensor: no reciprocal shortcut on any backend
    bits = v.view(torch.int32).to(torch.int64) & 0x7FFFFFFF  # amax >= 0; ignore a NaN's sign
    exponent = bits >> 23
    mantissa = bits & 0x7FFFFF
    normal = (exponent + (mantissa != 0).long()).clamp(max=254)
    subnormal = (mantissa > 0x400000).long()
    biased = torch.where(exponent == 0, subnormal, normal)
    biased = torch.where(bits > 0x7F800000, 255, biased)
    return biased.to(torch.uint8)


def encode_multiplier(biased: torch.Tensor) -> torch.Tensor:
    """The fp32 factor that maps a block into FP8 range: 2^(127 - biased), built from bits.

    biased 0 (a zero or tiny block) gives 1.0, as TE defines it, so zero blocks give zero data;
    255 gives NaN; 254 gives 2^-127 (subnormal, exact).
    """
    b = biased.long()
    bits = torch.where(b == 254, _POW2_M127_BITS, (254 - b) << 23)
    bits = torch.where(b == 0, _ONE_BITS, bits)
    bits = torch.where(b == 255, _NAN_BITS, bits)
    return _bits_to_float(bits)


def decode_scale(biased: torch.Tensor) -> torch.Tensor:
    """The fp32 decode scale 2^(biased - 127), built from bits (0 -> 2^-127, 255 -> NaN)."""
    b = biased.long()
    bits = torch.where(b == 0, _POW2_M127_BITS, b << 23)
    bits = torch.where(b == 255, _NAN_BITS, bits)
    return _bits_to_float(bits)


def _blocked(x: torch.Tensor, axis: int) -> torch.Tensor:
    """(M, K) viewed as (M, K/32, 32) for axis=1 or (M/32, 32, K) for axis=0."""
    m, k = x.shape
    return x.reshape(m, k // BLOCK_LEN, BLOCK_LEN) if axis == 1 else x.reshape(m // BLOCK_LEN, BLOCK_LEN, k)


def _block_dim(axis: int) -> int:
    return 2 if axis == 1 else 1


def quantize(
    x: torch.Tensor,
    fp8_dtype: str,
    *,
    axis: int,
    scales: Callable[[torch.Tensor, str], tuple[torch.Tensor, torch.Tensor]] = e8m0_scales,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8-encode a 2-D tensor: blocks of 32 along ``axis`` (1: 1x32 rows, 0: 32x1 columns).

    Block amax = max |x.float()| (NaN if the block holds a NaN; taken in x's dtype, which is exact
    and keeps a compiler from holding an fp32 copy of x between the amax and the cast);
    biased = e8m0_from_amax(amax);
    data = cast_to_fp8(x.float() * encode_multiplier(biased)) (one exact or RNE fp32 multiply,
    then RNE saturating cast). Data keeps x's (M, K) layout; scales are uint8 of shape
    (M, K/32) for axis=1 and (M/32, K) for axis=0, both with their outer dim (M, K) contiguous:
    a 1x32 scale is stored as its transpose, so that the scales of a run of rows are one run in
    memory (as the spec stores 1x128 block scales). The blocked dim must be a multiple of 32.
    ``scales`` makes (biased, multiplier) from the amaxes: ``e8m0_scales``, or the same numbers as
    an op (graphquant::e8m0_scales) where the quantize is traced into a graph.
    """
    blocks = _blocked(x, axis)
    dim = _block_dim(axis)
    amax = blocks.abs().amax(dim).float()
    if axis == 1:
        biased, multiplier = (s.t() for s in scales(amax.t().contiguous(), fp8_dtype))
    else:
        biased, multiplier = scales(amax, fp8_dtype)
    scaled = blocks.float() * multiplier.unsqueeze(dim)
    return cast_to_fp8(scaled, fp8_dtype).reshape(x.shape), biased


def dequantize(data: torch.Tensor, scales: torch.Tensor, *, axis: int) -> torch.Tensor:
    """float32 values data.float() * 2^(biased - 127) per block (one fp32 multiply, RNE)."""
    dim = _block_dim(axis)
    values = _blocked(data.float(), axis) * decode_scale(scales).unsqueeze(dim)
    return values.reshape(data.shape)
