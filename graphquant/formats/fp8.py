"""FP8 element formats: the cast, the amax, and TE's scale-from-amax rule.

Every rounding step is spelled out, because native kernels are compared to these bit for bit.
"""

from __future__ import annotations

import torch

from graphquant.ops import registry

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
FLT_MAX = torch.finfo(torch.float32).max
# Sign and exponent bits of an fp32 (0xFF800000 as a signed int32).
_SIGN_EXPONENT_MASK = -0x800000


def fp8_max(fp8_dtype: str) -> float:
    """The largest finite value of the FP8 format: 448 (e4m3) or 57344 (e5m2)."""
    return _FP8_MAX[fp8_dtype]


def cast_to_fp8(x: torch.Tensor, fp8_dtype: str) -> torch.Tensor:
    """float32 -> FP8, round to nearest even, saturating.

    Values beyond +-max (inf included) become +-max; NaN stays NaN (torch.clamp propagates it).
    The clamp is explicit because torch's own cast differs by format and device (e5m2 keeps inf
    and overflows to inf); clamping first to the largest finite value leaves only the RNE step.
    """
    limit = fp8_max(fp8_dtype)
    return torch.clamp(x, -limit, limit).to(FP8_DTYPES[fp8_dtype])


_LOOPED_ROW = 4096  # elements; Inductor loops over longer rows
_CHUNK = 512


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """max(|x|) as a float32 0-dim tensor; NaN propagates, an empty tensor gives 0.

    Taken in x's own dtype and then widened: abs and max are exact and rounding to fp32 is
    monotonic, so this equals max(|x.float()|). max is exact in any order, so the reduction takes
    the shape Inductor runs fastest when traced into x's producer (benchmarks/inductor_quantize.py
    on the H200): row maxima first, not a split reduction of the flat tensor (4-10% faster); a row
    longer than ``_LOOPED_ROW`` elements, which Inductor would loop over, in chunks of ``_CHUNK``
    (a SwiGLU's h 8-13% faster, its gradients 4%). Shorter rows stay whole, so a norm's output
    takes its amax in the norm's own row kernel.
    """
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    magnitudes = x.abs()
    if x.dim() > 1 and x.shape[-1] > _LOOPED_ROW and x.shape[-1] % _CHUNK == 0:
        magnitudes = magnitudes.reshape(-1, _CHUNK)
    return magnitudes.amax(-1).amax().to(torch.float32)



def scale_from_amax(
    amax: torch.Tensor, fp8_dtype: str, *, epsilon: float = 0.0, pow2: bool = False
) -> torch.Tensor:
    """TE's C++ ``compute_scale_from_amax``, elementwise over amaxes of any shape (float32).

    1. amax < epsilon -> epsilon.
    2. scale = fp8_max / amax, one correctly rounded fp32 division. (Not ``fp8_max / amax`` on a
       Python float: torch computes that as reciprocal(amax) * fp8_max, two roundings.)
    3. scale inf -> FLT_MAX; scale NaN (amax NaN) -> 1; amax 0 or inf -> 1.
    4. pow2: keep the fp32 sign and exponent bits, which rounds the (positive) scale down to a
       power of two.
    """
    amax = amax.to(torch.float32)
    amax = torch.where(amax < epsilon, torch.full_like(amax, epsilon), amax)
    scale = torch.div(torch.full_like(amax, fp8_max(fp8_dtype)), amax)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, FLT_MAX), scale)
    one = torch.ones_like(scale)
    scale = torch.where(torch.isnan(scale), one, scale)
    scale = torch.where((amax == 0) | torch.isinf(amax), one, scale)
    if pow2:
        scale = (scale.view(torch.int32) & _SIGN_EXPONENT_MASK).view(torch.float32)
    return scale


def scales(amax: torch.Tensor, fp8_dtype: str, epsilon: float, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, reciprocal(scale)) from ``scale_from_amax``, elementwise, as an op a graph compiler
    cannot approximate or reassociate: the rest of a quantize (amax, multiply, clamp, cast) is
    exact in any order and fuses freely with its neighbours. The op is functional, so a graph
    that quantizes one tensor for several GEMMs computes its scale once (common-subexpression
    elimination) and writes one copy of each representation. On CUDA it is one Triton launch
    (graphquant.triton_scales, bit-identical).
    """
    return scales_op(amax, fp8_dtype, epsilon, pow2)


@registry.op("fp8_scales")
def scales_op(amax: torch.Tensor, fp8_dtype: str, epsilon: float, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of ``scales`` as one op."""
    scale = scale_from_amax(amax, fp8_dtype, epsilon=epsilon, pow2=pow2)
    return scale, torch.reciprocal(scale)


@registry.fake("fp8_scales")
def _(amax, fp8_dtype, epsilon, pow2):
    return torch.empty_like(amax, dtype=torch.float32), torch.empty_like(amax, dtype=torch.float32)
