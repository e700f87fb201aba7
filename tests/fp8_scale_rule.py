"""One launch of the FP8 scale rule that graphquant's Triton kernels inline
(triton_scales.fp8_scale and reciprocal), to compare with fp8.scales on every special amax: on the
GPU, and under Triton's interpreter."""

import torch
import triton
import triton.language as tl

from graphquant.formats import fp8
from graphquant.kernels.triton_scales import fp8_scale, reciprocal


@triton.jit
def _scales_kernel(amax_ptr, scale_ptr, inverse_ptr, n, FP8_MAX: tl.constexpr, EPSILON: tl.constexpr, POW2: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    scale = fp8_scale(tl.load(amax_ptr + offsets, mask=mask, other=1.0), FP8_MAX, EPSILON, POW2)
    tl.store(scale_ptr + offsets, scale, mask=mask)
    tl.store(inverse_ptr + offsets, reciprocal(scale), mask=mask)


def kernel_scales(amax: torch.Tensor, fp8_dtype: str, epsilon: float, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, inverse) of float32 ``amax`` by the kernels' rule."""
    amax = amax.contiguous()
    scale, inverse = torch.empty_like(amax), torch.empty_like(amax)
    block = 1024
    _scales_kernel[(-(-amax.numel() // block),)](
        amax, scale, inverse, amax.numel(), FP8_MAX=fp8.fp8_max(fp8_dtype), EPSILON=float(epsilon), POW2=pow2, BLOCK=block
    )
    return scale, inverse
