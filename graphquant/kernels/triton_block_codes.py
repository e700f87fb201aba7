"""MXFP8's and NVFP4's codes made inside a Triton program from high-precision values, bit for bit
those of the reference quantizers (graphquant/formats mxfp8.py, nvfp4.py), packed as the decode
GEMM reads stored codes: 64-bit words of 8 E4M3 codes (byte j: column j of the word) or of 16
E2M1 codes (nibble j: column j). Every step is the reference's, in its order: exact, a
comparison, or one fp32 operation rounded to nearest even (div_rn, the FP8 casts' rtne with
saturation), so a program that quantizes its own tile of an activation multiplies what the
reference quantizer would have stored. The values come as one tensor per place in a word (value
j of every word), so that the words are made elementwise in the layout of the words themselves.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphquant.formats import nvfp4
from graphquant.kernels.triton_scales import e8m0_biased, e8m0_multiplier, fp8_codes

_FLT_MAX: tl.constexpr = tl.constexpr(nvfp4.FLT_MAX)
_NVFP4_ENCODE: tl.constexpr = tl.constexpr(nvfp4.E4M3_MAX * nvfp4.E2M1_MAX)
_ONE_SIXTH_BITS: tl.constexpr = tl.constexpr(0x3E2AAAAB)  # fp32(1/6), nvfp4.quantize's multiplier


@triton.jit
def _magnitude_bits(x):
    """|x|'s fp32 bits as int32, ordered as the magnitudes are, NaN above infinity: their max is
    the reference's amax, a NaN included."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _finite(x):
    """min(x, FLT_MAX) as torch.minimum takes it: NaN stays NaN."""
    return tl.where(x > _FLT_MAX, _FLT_MAX, x)


@triton.jit
def mxfp8_words(x, FP8_MAX: tl.constexpr, CODE: tl.constexpr):
    """MXFP8's codes (element CODE, largest finite FP8_MAX) of 8 fp32 tensors ``x`` (..., 4), the
    j-th holding value j of each word, a 32-block's 4 words along the last dim: (the words (..., 4)
    as int64, each block's E8M0 exponent (..., 1), int32)."""
    word_max = _magnitude_bits(x[0])
    for j in tl.static_range(1, 8):
        word_max = tl.maximum(word_max, _magnitude_bits(x[j]))
    biased = e8m0_biased(tl.max(word_max, -1, keep_dims=True).to(tl.float32, bitcast=True), FP8_MAX)
    multiplier = e8m0_multiplier(biased)
    words = tl.zeros(word_max.shape, tl.int64)
    for j in tl.static_range(8):
        words |= fp8_codes(x[j], multiplier, FP8_MAX, CODE).to(tl.uint8, bitcast=True).to(tl.int64) << (8 * j)
    return words, biased


@triton.jit
def nvfp4_words(x, amax):
    """NVFP4's codes of 16 fp32 tensors ``x``, the j-th holding value j of each 16-block, under
    the global ``amax`` (fp32, broadcast over the blocks: the tensor's, or each row's): (the
    blocks as int64 words, their E4M3 scales widened to fp16, exact)."""
    block_max = _magnitude_bits(x[0])
    for j in tl.static_range(1, 16):
        block_max = tl.maximum(block_max, _magnitude_bits(x[j]))
    s_enc = _finite(tl.math.div_rn(tl.full(amax.shape, _NVFP4_ENCODE, tl.float32), amax))
    s_enc = tl.where((s_enc == 0.0) | (amax == 0.0), 1.0, s_enc)
    s_dec = tl.math.div_rn(tl.full(s_enc.shape, 1.0, tl.float32), s_enc)
    multiplier = s_enc * tl.full(s_enc.shape, _ONE_SIXTH_BITS, tl.int32).to(tl.float32, bitcast=True)
    scale = fp8_codes(block_max.to(tl.float32, bitcast=True), multiplier, 448.0, tl.float8e4nv)
    denominator = scale.to(tl.float32) * s_dec
    encode = _finite(tl.math.div_rn(tl.full(denominator.shape, 1.0, tl.float32), denominator))
    words = tl.zeros(block_max.shape, tl.int64)
    for j in tl.static_range(16):
        words |= _e2m1_code(x[j] * encode).to(tl.int64) << (4 * j)
    return words, scale.to(tl.float16)


@triton.jit
def _e2m1_code(v):
    """nvfp4.round_to_e2m1 of fp32 ``v`` without random bits: sign in bit 3, the magnitude's index
    by nearest-even thresholds, NaN as +6's code."""
    a = tl.abs(v)
    index = (
        (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + (a >= 1.75).to(tl.int32)
        + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)
    )
    sign = (v.to(tl.int32, bitcast=True) < 0).to(tl.int32) << 3
    return tl.where(v != v, 7, index | sign)
