"""FP8 element formats: the cast, the amax, TE's scale-from-amax rule, and how far a sum of FP8
products may lie from the exact one on Hopper (``accumulation_bound``).

Every rounding step is spelled out, because native kernels are compared to these bit for bit.
The accumulation model's numbers are read off the H200 by benchmarks/accumulation_probe.py
(benchmarks/NOTES.md): PROMOTED_PRODUCTS is the promotion interval it reads off cuBLASLt's
promoted FP8 GEMM, and ACCUMULATOR_FRACTION_BITS the bits below a large product that a small one
keeps in the same step, in cuBLASLt's and Triton's FP8 GEMMs alike; WGMMA_PRODUCTS is the depth
of an FP8 wgmma in the PTX ISA.
"""

from __future__ import annotations

import math
import struct
from typing import Callable, Optional

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
FLT_MAX = torch.finfo(torch.float32).max
# Hopper's FP8 tensor cores sum each wgmma's WGMMA_PRODUCTS products and the partial sum carried
# in at a fixed point aligned to the largest of them, dropping every bit more than
# ACCUMULATOR_FRACTION_BITS below its leading one; a GEMM that promotes adds that partial sum into
# fp32 after every PROMOTED_PRODUCTS products (cuBLASLt without fast accumulation, and graphquant's
# Triton FP8 GEMMs), one that accumulates fast never.
WGMMA_PRODUCTS = 32
ACCUMULATOR_FRACTION_BITS = 13
PROMOTED_PRODUCTS = 128
# ``accumulation_bound``'s promote_every for the other two ways to sum: FAST, the tensor cores'
# accumulator alone (never promoted); FP32, each product added in fp32 (CUDA cores' FMAs, the
# Triton interpreter, the emulation's fp32 GEMMs).
FAST = None
FP32 = 1
_FP32_UNIT_ROUNDOFF = 2.0**-24
_ACCUMULATOR_ULP = 2.0**-ACCUMULATOR_FRACTION_BITS
# Sign and exponent bits of an fp32 (0xFF800000 as a signed int32).
_SIGN_EXPONENT_MASK = -0x800000
_MANTISSA_MASK = 0x7FFFFF
_EXPONENT_BIAS = 127
_MAX_EXPONENT = 254  # biased: 2^127
_SMALLEST_POW2_BITS = 1 << 22  # 2^-127, subnormal


def accumulation_bound(a: torch.Tensor, b: torch.Tensor, promote_every: Optional[int]) -> torch.Tensor:
    """An elementwise bound on |computed - exact| of a @ b (float64, a (..., m, k) and b (..., k, n):
    values whose products are exact, FP8's, or bounds on their magnitudes) where the tensor
    cores' accumulator sums the products in k's order, ``promote_every`` at a time from k = 0,
    before fp32 takes their partial sum: PROMOTED_PRODUCTS, FAST or FP32.

    Each wgmma aligns its products and the partial sum carried in to the largest of them: every
    other term loses less than 2^-ACCUMULATOR_FRACTION_BITS of that largest's leading bit (at most
    that of the largest product's bound, max |a| times max |b| over the wgmma's products, or of
    the carried sum's: the step's exact partial sum and what it has lost), and the result, where
    it outgrows them, as much of its own. fp32 then adds the steps' partial sums in some order:
    gamma(steps - 1) of their magnitudes (Higham, Accuracy and Stability, 3.1), counting a step a
    wgmma, so that a GEMM promoting more often (at a K tile's end) is within the bound too; under
    FP32 each product is a step of its own.
    """
    magnitude = a.abs() @ b.abs()
    k = a.shape[-1]
    if promote_every == FP32:
        return _gamma(k - 1) * magnitude
    step = max(k, 1) if promote_every is FAST else promote_every
    narrow = torch.zeros_like(magnitude)
    for first in range(0, k, step):
        partial, lost = torch.zeros_like(magnitude), torch.zeros_like(magnitude)
        for start in range(first, min(first + step, k), WGMMA_PRODUCTS):
            stop = min(start + WGMMA_PRODUCTS, first + step, k)
            a_w, b_w = a[..., start:stop], b[..., start:stop, :]
            largest = torch.maximum(partial.abs() + lost, a_w.abs().amax(-1, keepdim=True) * b_w.abs().amax(-2, keepdim=True))
            partial = partial + a_w @ b_w
            dropped = (stop - start) * _ACCUMULATOR_ULP * _leading_bit(largest)
            lost = lost + dropped + _ACCUMULATOR_ULP * _leading_bit(partial.abs() + lost + dropped)
        narrow += lost
    steps = 1 if promote_every is FAST else math.ceil(k / WGMMA_PRODUCTS)
    return narrow + _gamma(steps - 1) * (magnitude + narrow)


def _leading_bit(x: torch.Tensor) -> torch.Tensor:
    """The largest power of two at most x (x >= 0; 0 stays 0)."""
    return torch.exp2(torch.floor(torch.log2(x)))


def _gamma(n: int) -> float:
    """Higham's gamma_n = n u / (1 - n u) for fp32's unit roundoff u: the error of a sum whose
    every term is rounded at most n times, per unit of their magnitudes."""
    return n * _FP32_UNIT_ROUNDOFF / (1 - n * _FP32_UNIT_ROUNDOFF)


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
_CHUNKS = (1024, 512)  # the first that divides such a row
_MAGNITUDE_BITS = 0x7FFFFFFF  # an fp32's bits without its sign
_INF_BITS = 0x7F800000  # +inf; every larger magnitude pattern is a NaN


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """max(|x|) as a float32 0-dim tensor; NaN propagates, an empty tensor gives 0.

    Taken as an integer max of x's float32 bit patterns with the sign cleared: those order as the
    magnitudes do, NaN above infinity, so the max is exact, and on the GPU it is one integer
    instruction an element where a float max that propagates NaN takes three or four, which counts
    in amax passes that the GPU's power cap makes compute-bound. Where Inductor fuses a bf16 x
    into its producer it keeps x's values unrounded in float32, so the max is rounded to bf16
    after the reduction, in integers, which Inductor cannot elide: rounding is monotonic, so that
    is the max of the rounded values, as eager computes it. fp16 keeps a float max in its own
    dtype (exact too), whose partial maxima Inductor stores, and so rounds, as fp16.
    """
    if statically_known_true(x.numel() != 0):
        return reduced_amax(x, _max_of_all)
    return reduced_amax(x, max_with_zero)  # empty, or of a size known only at run time (rows a data-dependent op chose)


def reduced_amax(x: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """max |x| as float32 over what ``reduce`` (a max over some of its argument's dims) reduces,
    exact for x as stored in its dtype even where Inductor fuses x into its producer
    (``tensor_amax`` says how)."""
    if x.dtype == torch.float16:
        return reduce(x.abs()).to(torch.float32)
    bits = reduce(magnitude_bits(x))
    if x.dtype == torch.bfloat16:
        bits = rounded_to_bfloat16(bits)
    return bits.view(torch.float32)


def row_chunk_amax(x: torch.Tensor) -> torch.Tensor:
    """float32 (rows, chunks): max |x| over each chunk of each row of 2-D ``x``, exact for x as
    stored (``reduced_amax``): a row longer than ``_LOOPED_ROW`` elements in the chunks
    ``tensor_amax`` takes, a shorter one whole, so that it is one reduction Inductor fuses into
    x's producer. The max of a row's chunks is the row's amax; of all of them, the tensor's."""
    rows, cols = x.shape
    chunk = next((c for c in _CHUNKS if cols % c == 0), cols) if cols > _LOOPED_ROW else cols
    return reduced_amax(x.reshape(rows, cols // max(chunk, 1), max(chunk, 1)), lambda t: t.amax(-1))


def magnitude_bits(x: torch.Tensor) -> torch.Tensor:
    """|x|'s float32 bit patterns as int32, ordered as the magnitudes are (NaN above infinity)."""
    return x.float().view(torch.int32) & _MAGNITUDE_BITS


def _max_of_all(t: torch.Tensor) -> torch.Tensor:
    """The max of all of ``t`` in the shape Inductor runs fastest when traced into t's producer
    (max is exact in any order; benchmarks/inductor_quantize.py times the shapes): row maxima
    first, which Inductor fuses into the producer's row loop, not a split reduction of the flat
    tensor; a row longer than ``_LOOPED_ROW`` elements, which Inductor would loop over, in chunks
    short enough for a persistent reduction. Shorter rows stay whole, so a norm's output takes its
    amax in the norm's own row kernel."""
    if t.dim() > 1 and t.shape[-1] > _LOOPED_ROW:
        chunk = next((c for c in _CHUNKS if t.shape[-1] % c == 0), None)
        if chunk is not None:
            t = t.reshape(-1, chunk)
    return t.amax(-1).amax()


def max_with_zero(t: torch.Tensor) -> torch.Tensor:
    """The max of all of non-negative ``t`` and a zero: 0 where t is empty, which a plain max
    refuses, for a size the graph may not know (no guard can be taken on it)."""
    if t.dim() > 1 and statically_known_true(t.shape[-1] != 0):
        t = t.amax(-1)  # rows of known length: their maxima, few values to pad
    return torch.nn.functional.pad(t.flatten(), (0, 1)).amax()


def rounded_to_bfloat16(bits: torch.Tensor) -> torch.Tensor:
    """Non-negative float32 bit patterns rounded to bf16 (to nearest, ties to even: torch's rule),
    as float32 bit patterns; NaN stays NaN."""
    finite = torch.clamp_max(bits, _INF_BITS)  # a NaN's pattern plus the bias would overflow
    rounded = (finite + (0x7FFF + ((finite >> 16) & 1))) & -0x10000
    return torch.where(bits > _INF_BITS, bits, rounded)


def scale_from_amax(
    amax: torch.Tensor, fp8_dtype: str, *, epsilon: float = 0.0, pow2: bool = False
) -> torch.Tensor:
    """TE's C++ ``compute_scale_from_amax``, elementwise over amaxes of any shape (float32).

    1. amax < epsilon -> epsilon.
    2. scale = fp8_max / amax, one correctly rounded fp32 division (``correctly_rounded_quotient``).
    3. scale inf -> FLT_MAX; scale NaN (amax NaN) -> 1; amax 0 or inf -> 1.
    4. pow2: keep the fp32 sign and exponent bits, which rounds the (positive) scale down to a
       power of two.
    """
    amax = amax.to(torch.float32)
    amax = torch.where(amax < epsilon, torch.full_like(amax, epsilon), amax)
    scale = correctly_rounded_quotient(torch.full_like(amax, fp8_max(fp8_dtype)), amax)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, FLT_MAX), scale)
    one = torch.ones_like(scale)
    scale = torch.where(torch.isnan(scale), one, scale)
    scale = torch.where((amax == 0) | torch.isinf(amax), one, scale)
    if pow2:
        scale = (scale.view(torch.int32) & _SIGN_EXPONENT_MASK).view(torch.float32)
    return scale


def correctly_rounded_quotient(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a / b of float32 tensors, correctly rounded to float32, as plain ops a graph compiler may
    fuse: the float64 quotient rounded once to float32 is the correctly rounded one (53 bits hold
    more than 2 x 24 + 2, so the two roundings never differ from one). Compiled code keeps float64
    division IEEE (Triton's div.rn) where its float32 division is approximate (div.full). Not
    ``fp8_max / amax`` on a Python float either: torch computes that as reciprocal(amax) * fp8_max,
    two roundings."""
    return torch.div(a.double(), b.double()).float()


def scales(amax: torch.Tensor, fp8_dtype: str, epsilon: float, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, reciprocal(scale)) from ``scale_from_amax``, elementwise, each correctly rounded. A
    quantize traced into a graph takes them by float8.traced_scales, the same numbers."""
    scale = scale_from_amax(amax, fp8_dtype, epsilon=epsilon, pow2=pow2)
    return scale, correctly_rounded_quotient(torch.ones_like(scale), scale)


def pow2_scales(amax: torch.Tensor, fp8_dtype: str, epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``scales`` with pow2, the same bits, from the amax's bits by integer ops alone: a graph
    compiler fuses them into the quantize around them and has no division to round otherwise.

    fp8_max / amax lies in [1, 2) times 2^(its exponent - amax's) where amax's significand is at
    most fp8_max's (1.75 for both FP8 encodings), else in [0.875, 1) times that: the correctly
    rounded quotient never rounds into the next octave, since 1.75 is not within half an fp32 ulp
    of a significand's quotient. Past 2^127 the quotient overflows to FLT_MAX, whose power of two
    is 2^127; its reciprocal 2^-127 is subnormal. amax is non-negative or NaN, as amaxes are.
    """
    amax = amax.to(torch.float32)
    amax = torch.where(amax < epsilon, torch.full_like(amax, epsilon), amax)
    bits = amax.view(torch.int32)
    (top,) = struct.unpack("<i", struct.pack("<f", fp8_max(fp8_dtype)))
    lower_octave = ((bits & _MANTISSA_MASK) > (top & _MANTISSA_MASK)).to(torch.int32)
    exponent = ((top >> 23) - (bits >> 23) + _EXPONENT_BIAS - lower_octave).clamp(max=_MAX_EXPONENT)
    scale = (exponent << 23).view(torch.float32)
    inverse = torch.where(exponent == _MAX_EXPONENT, _SMALLEST_POW2_BITS, (_MAX_EXPONENT - exponent) << 23)
    one = torch.ones_like(scale)
    special = (amax == 0) | torch.isinf(amax) | torch.isnan(amax)
    return torch.where(special, one, scale), torch.where(special, one, inverse.view(torch.float32))
