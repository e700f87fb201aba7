"""IdentityQuantizer: keep the slot in high precision."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from graphquant.quantizers.base import COLUMNWISE, ROWWISE, QuantizeContext, Quantizer, Representation


@dataclasses.dataclass(frozen=True)
class IdentityQuantizer(Quantizer):
    """High precision: the tensor itself (detached), optionally held in ``dtype``.

    One buffer serves both directions; a GEMM reads it transposed where it needs to.
    """

    tag = "identity"
    traceable = True
    high_precision = True
    groupable = True

    dtype: Optional[torch.dtype] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dtype is not None and not (self.dtype.is_floating_point and self.dtype.itemsize >= 2):
            raise ValueError(f"IdentityQuantizer.dtype must be float16, bfloat16 or float32, got {self.dtype}")

    def _hold(self, x: torch.Tensor, direction: str) -> Representation:
        data = x.detach()
        return self.representation(direction, x.shape, x.dtype, data if self.dtype is None else data.to(self.dtype))

    def quantize_rowwise(self, x: torch.Tensor, ctx: QuantizeContext) -> Representation:
        return self._hold(x, ROWWISE)

    def quantize_columnwise(self, x: torch.Tensor, ctx: QuantizeContext) -> Representation:
        return self._hold(x, COLUMNWISE)

    def dequantize(self, rep: Representation) -> torch.Tensor:
        return rep.data

    def emulated_values(self, rep: Representation) -> torch.Tensor:
        return rep.data  # the values themselves, no copy

    def values_exact_in_bf16(self, rep: Representation) -> bool:
        return rep.data.dtype == torch.bfloat16
