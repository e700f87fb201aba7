"""The exact MXFP8 scale op, graphquant::e8m0_scales.

A traced MXFP8 quantize takes its scales from this op, so that a graph compiler fusing the rest of
the quantize (amax, multiply, cast: exact in any order) can neither approximate nor reassociate
its division. It is functional, so a graph that quantizes one tensor for several GEMMs computes
its scales once (common-subexpression elimination). Its numbers are mxfp8.e8m0_scales'; on CUDA it
is one Triton launch where Triton exists (graphquant.kernels.triton_scales, bit-identical). FP8's
scales need no op: float8.traced_scales spells them as plain ops that keep their bits compiled.
"""

from __future__ import annotations

import torch

from graphquant.formats import mxfp8
from graphquant.ops import registry


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
    registry.cuda_kernel("e8m0_scales")(triton_scales.e8m0_scales)
