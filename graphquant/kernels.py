"""Where quantize and dequantize run: the native extension when it has a kernel, else the reference.

The op layer calls only ``quantize`` and ``dequantize`` here, so native kernels plug in without
touching the passes or the ops. A kernel is used only for a CUDA tensor and a format the
extension implements; everything else runs ``graphquant.formats`` (the numerics contract).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from graphquant.quantizers import ROWWISE, QuantizeContext, Quantizer, Representation


@functools.lru_cache(maxsize=None)
def native() -> Optional[Any]:
    """graphquant._C if it was built with CUDA kernels, else None."""
    try:
        from graphquant import _C
    except ImportError:
        return None
    return _C if getattr(_C, "cuda_built", False) else None


def reference_quantize(quantizer: Quantizer, x: torch.Tensor, direction: str, ctx: QuantizeContext) -> Representation:
    if direction == ROWWISE:
        return quantizer.quantize_rowwise(x, ctx)
    return quantizer.quantize_columnwise(x, ctx)


def quantize(quantizer: Quantizer, x: torch.Tensor, direction: str, ctx: QuantizeContext) -> Representation:
    quantizer.check_shape(tuple(x.shape), direction)
    return reference_quantize(quantizer, x, direction, ctx)


def dequantize(rep: Representation) -> torch.Tensor:
    """Stored-orientation values in the representation's nominal dtype."""
    return rep.dequantize()
