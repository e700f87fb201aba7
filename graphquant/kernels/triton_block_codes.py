"""MXFP8's and NVFP4's codes made inside a Triton program from high-precision values, bit for bit
those of the reference quantizers (graphquant/formats mxfp8.py, nvfp4.py), packed as the decode
GEMM reads stored codes: 64-bit words of 8 E4M3 codes (byte j: column j of the word) or of 16
E2M1 codes (nibble j: column j). Every step is the reference's, in its order: exact, a
comparison, or one fp32 operation rounded to nearest even (div_rn, the FP8 casts' rtne with
saturation), so a program that quantizes its own tile of an activation multiplies what the
reference quantizer would have stored.
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
    """MXFP8's codes (element CODE, largest finite FP8_MAX) of fp32 ``x`` (..., W, 8), the 8
    values of each of W words, W a multiple of 4 (a word's 32-block is it and its 3 neighbours
    along W, from the first): (the words (..., W) as int64, each word's E8M0 exponent, int32)."""
    word_max = tl.max(_magnitude_bits(x), -1)
    blocks: tl.constexpr = word_max.numel // 4
    block_max = tl.max(tl.reshape(word_max, (blocks, 4)), 1)
    biased = tl.reshape(tl.broadcast_to(block_max[:, None], (blocks, 4)), word_max.shape)
    biased = e8m0_biased(biased.to(tl.float32, bitcast=True), FP8_MAX)
    codes = fp8_codes(x, tl.expand_dims(e8m0_multiplier(biased), -1), FP8_MAX, CODE).to(tl.uint8, bitcast=True)
    return _packed(codes, 8), biased


@triton.jit
def nvfp4_words(x, amax):
    """NVFP4's codes of fp32 ``x`` (..., 16), each 16-block's values, under the global ``amax``
    (fp32, broadcast over the blocks: the tensor's, or each row's): (the blocks as int64 words,
    their E4M3 scales widened to fp16, exact)."""
    block_max = tl.max(_magnitude_bits(x), -1).to(tl.float32, bitcast=True)
    s_enc = _finite(tl.math.div_rn(tl.full(amax.shape, _NVFP4_ENCODE, tl.float32), amax))
    s_enc = tl.where((s_enc == 0.0) | (amax == 0.0), 1.0, s_enc)
    s_dec = tl.math.div_rn(tl.full(s_enc.shape, 1.0, tl.float32), s_enc)
    multiplier = s_enc * tl.full(s_enc.shape, _ONE_SIXTH_BITS, tl.int32).to(tl.float32, bitcast=True)
    scale = fp8_codes(block_max, multiplier, 448.0, tl.float8e4nv)
    denominator = scale.to(tl.float32) * s_dec
    encode = _finite(tl.math.div_rn(tl.full(denominator.shape, 1.0, tl.float32), denominator))
    return _packed(_e2m1_codes(x * tl.expand_dims(encode, -1)), 4), scale.to(tl.float16)


@triton.jit
def _e2m1_codes(v):
    """nvfp4.round_to_e2m1 of fp32 ``v`` without random bits: sign in bit 3, the magnitude's index
    by nearest-even thresholds, NaN as +6's code."""
    a = tl.abs(v)
    index = (
        (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + (a >= 1.75).to(tl.int32)
        + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)
    )
    sign = (v.to(tl.int32, bitcast=True) < 0).to(tl.int32) << 3
    return tl.where(v != v, 7, index | sign)


@triton.jit
def _packed(codes, BITS: tl.constexpr):
    """Codes (..., n) of BITS bits each as one int64 word (...), code j in bits BITS j on."""
    shift = (tl.arange(0, codes.shape[-1]) * BITS).to(tl.int64)
    return tl.sum(codes.to(tl.int64) << shift, -1)
