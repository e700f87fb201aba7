"""The exact scale ops, graphquant::fp8_scales and graphquant::e8m0_scales.

A quantize traced into a graph takes the scales of FP8's 2-D tiles and groups, and MXFP8's, from
these ops (FP8's other scales are plain ops: float8.traced_scales says why), so that a graph
compiler fusing the rest of the quantize (amax, multiply, clamp, cast: exact in any order) can
neither approximate nor reassociate the division, nor repeat it for every element. They
are functional, so a graph that quantizes one tensor for several GEMMs computes its scales once
(common-subexpression elimination) and writes one copy of each representation. Their numbers are
graphquant.formats' (fp8.scales, mxfp8.e8m0_scales); on CUDA each is one Triton launch where
Triton exists (graphquant.kernels.triton_scales, bit-identical).
"""

from __future__ import annotations

import torch

from graphquant.formats import fp8, mxfp8
from graphquant.ops import registry


@registry.op("fp8_scales")
def fp8_scales(amax: torch.Tensor, fp8_dtype: str, epsilon: float, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8.scales`` as one op: (scale, reciprocal(scale)) of each amax."""
    return fp8.scales(amax, fp8_dtype, epsilon, pow2)


@registry.fake("fp8_scales")
def _(amax, fp8_dtype, epsilon, pow2):
    return torch.empty_like(amax, dtype=torch.float32), torch.empty_like(amax, dtype=torch.float32)


@registry.op("e8m0_scales")
def e8m0_scales(amax: torch.Tensor, fp8_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``mxfp8.e8m0_scales`` as one op: each block's biased E8M0 exponent and encode multiplier.

    The multiplier is an output, so the cast that applies it is one multiply: built from the
    bits inside the cast, its integer chain can push the cast of a long producer (a SwiGLU
    backward) past Inductor's inlining limit, which then stores the fp32 product in memory.
    """
    return mxfp8.e8m0_scales(amax, fp8_dtype)


@registry.fake("e8m0_scales")
def _(amax, fp8_dtype):
    return torch.empty_like(amax, dtype=torch.uint8), torch.empty_like(amax, dtype=torch.float32)


try:
    from graphquant.kernels import triton_scales
except ImportError:  # no Triton: CUDA tensors run the reference
    pass
else:
    registry.cuda_kernel("fp8_scales")(triton_scales.fp8_scales)
    registry.cuda_kernel("e8m0_scales")(triton_scales.e8m0_scales)
