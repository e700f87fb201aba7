"""CUDA kernels of the exact scale ops (graphquant.formats.fp8.scales, mxfp8.e8m0_scales).

Their references are a dozen tiny torch ops each; on a GPU inside a training step that is a dozen
launches per quantize. These kernels compute the same bits in one launch: divisions use div_rn
(IEEE round-to-nearest), and every other step is exact. graphquant.ops.scales registers them as
the CUDA implementations of the custom ops graphquant::fp8_scales and graphquant::e8m0_scales
(functional ops, so compiled graphs deduplicate them, which they cannot do for wrap_triton's
mutating launches).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphquant.formats import fp8
from graphquant.kernels.triton_launch import ceil_div

_BLOCK = 1024
# Scalars are compile-time constants, so the arithmetic stays fp32.
_FLT_MAX: tl.constexpr = tl.constexpr(fp8.FLT_MAX)


@triton.jit
def fp8_scale(amax, FP8_MAX: tl.constexpr, EPSILON: tl.constexpr, POW2: tl.constexpr):
    """fp8.scale_from_amax of float32 ``amax`` (any shape), the same bits."""
    amax = tl.where(amax < EPSILON, EPSILON, amax)
    scale = tl.math.div_rn(tl.full(amax.shape, FP8_MAX, tl.float32), amax)
    scale = tl.where(scale == float("inf"), tl.full(scale.shape, _FLT_MAX, tl.float32), scale)
    scale = tl.where(scale != scale, 1.0, scale)
    scale = tl.where((amax == 0.0) | (amax == float("inf")), 1.0, scale)
    if POW2:
        scale = (scale.to(tl.int32, bitcast=True) & -0x800000).to(tl.float32, bitcast=True)
    return scale


@triton.jit
def reciprocal(scale):
    """torch.reciprocal of float32 ``scale``, correctly rounded: a scale's decode factor."""
    return tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)


@triton.jit
def fp8_codes(x, scale, CODE: tl.constexpr):
    """per_tensor.quantize's codes of ``x`` under ``scale`` (broadcast): one fp32 product rounded
    to nearest even, saturating as fp8.cast_to_fp8 does. The cast saturates by itself (PTX's
    cvt.rn.satfinite, the reason passes/saturating_cast.py drops Inductor's clamps), so a clamp in
    front of it (four instructions a value) would change no code."""
    return (x.to(tl.float32) * scale).to(CODE, fp_downcast_rounding="rtne")


@triton.jit
def _scales_kernel(
    amax_ptr, scale_ptr, inverse_ptr, n, FP8_MAX: tl.constexpr, EPSILON: tl.constexpr, POW2: tl.constexpr, BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    scale = fp8_scale(tl.load(amax_ptr + offsets, mask=mask, other=1.0), FP8_MAX, EPSILON, POW2)
    tl.store(scale_ptr + offsets, scale, mask=mask)
    tl.store(inverse_ptr + offsets, reciprocal(scale), mask=mask)


@triton.jit
def e8m0_biased(amax, FP8_MAX: tl.constexpr):
    """mxfp8.e8m0_from_amax of float32 ``amax`` (any shape), the same bits, as int32."""
    v = tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32))
    bits = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    exponent, mantissa = bits >> 23, bits & 0x7FFFFF
    normal = tl.minimum(exponent + (mantissa != 0).to(tl.int32), 254)
    subnormal = (mantissa > 0x400000).to(tl.int32)
    biased = tl.where(exponent == 0, subnormal, normal)
    return tl.where(bits > 0x7F800000, 255, biased)


@triton.jit
def e8m0_multiplier(biased):
    """mxfp8.encode_multiplier: 2^(127 - biased) from bits; 0 -> 1.0, 254 -> 2^-127, 255 -> NaN."""
    multiplier = tl.where(biased == 254, 0x00400000, (254 - biased) << 23)
    multiplier = tl.where(biased == 0, 0x3F800000, multiplier)
    return tl.where(biased == 255, 0x7FC00000, multiplier).to(tl.float32, bitcast=True)


@triton.jit
def _e8m0_kernel(amax_ptr, out_ptr, multiplier_ptr, n, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    biased = e8m0_biased(tl.load(amax_ptr + offsets, mask=mask, other=0.0), FP8_MAX)
    tl.store(out_ptr + offsets, biased.to(tl.uint8), mask=mask)
    tl.store(multiplier_ptr + offsets, e8m0_multiplier(biased), mask=mask)


def fp8_scales(amax: torch.Tensor, fp8_dtype: str, epsilon: float, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    amax = amax.to(torch.float32).contiguous()
    scale, inverse = torch.empty_like(amax), torch.empty_like(amax)
    n = amax.numel()
    _scales_kernel[(ceil_div(n, _BLOCK),)](
        amax, scale, inverse, n, FP8_MAX=fp8.fp8_max(fp8_dtype), EPSILON=float(epsilon), POW2=pow2, BLOCK=_BLOCK
    )
    return scale, inverse


def e8m0_scales(amax: torch.Tensor, fp8_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    amax = amax.to(torch.float32).contiguous()
    out = torch.empty(amax.shape, dtype=torch.uint8, device=amax.device)
    multiplier = torch.empty_like(amax)
    n = amax.numel()
    _e8m0_kernel[(ceil_div(n, _BLOCK),)](amax, out, multiplier, n, FP8_MAX=fp8.fp8_max(fp8_dtype), BLOCK=_BLOCK)
    return out, multiplier
