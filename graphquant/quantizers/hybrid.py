"""HybridQuantizer: a different quantizer for each direction of one tensor."""

from __future__ import annotations

import dataclasses
import weakref
from typing import Optional

import torch

from graphquant.quantizers.base import COLUMNWISE, ROWWISE, QuantizeContext, Quantizer, Representation
from graphquant.quantizers.descriptions import GemmInput, KernelEncoding
from graphquant.quantizers.float8 import DelayedScalingRequest, Float8DelayedScalingQuantizer

COLUMNWISE_SOURCES = ("original", "rowwise_dequantized")

# Children already owned by a hybrid, by identity: a factory must build fresh children for each
# hybrid, as TransformerEngine requires, so that per-child state can never be shared by accident.
_OWNED_CHILDREN: "weakref.WeakValueDictionary[int, Quantizer]" = weakref.WeakValueDictionary()


@dataclasses.dataclass(frozen=True)
class HybridQuantizer(Quantizer):
    """Rowwise representation from one quantizer, columnwise from another.

    columnwise_source "original" quantizes both directions from the original tensor;
    "rowwise_dequantized" feeds the columnwise quantizer the dequantized rowwise values (so
    backward sees the forward's quantization error; use it for inputs and weights, not gradients).
    """

    tag = "hybrid"
    always_shown = ("rowwise_quantizer", "columnwise_quantizer", "columnwise_source")

    rowwise_quantizer: Quantizer
    columnwise_quantizer: Quantizer
    columnwise_source: str = "original"

    def __post_init__(self) -> None:
        super().__post_init__()
        for field in ("rowwise_quantizer", "columnwise_quantizer"):
            child = getattr(self, field)
            if isinstance(child, (DelayedScalingRequest, Float8DelayedScalingQuantizer)):
                raise TypeError(
                    f"HybridQuantizer.{field}: delayed scaling inside a hybrid is not supported; "
                    "use Float8CurrentScalingQuantizer, or return the delayed quantizer for the whole slot"
                )
            if not isinstance(child, Quantizer):
                raise TypeError(f"HybridQuantizer.{field} must be a Quantizer, got {type(child).__name__}")
            if isinstance(child, HybridQuantizer):
                raise TypeError(f"HybridQuantizer.{field} cannot itself be a HybridQuantizer")
        if self.rowwise_quantizer is self.columnwise_quantizer:
            raise ValueError(
                "HybridQuantizer got the same quantizer instance for both directions; "
                "build a separate child for each (e.g. call the factory twice)"
            )
        if self.columnwise_source not in COLUMNWISE_SOURCES:
            raise ValueError(
                f"HybridQuantizer.columnwise_source must be one of {COLUMNWISE_SOURCES}, got {self.columnwise_source!r}"
            )
        for child in (self.rowwise_quantizer, self.columnwise_quantizer):
            if _OWNED_CHILDREN.get(id(child)) is child:
                raise ValueError(
                    f"the child quantizer {child} already belongs to another HybridQuantizer; "
                    "build fresh children for every hybrid"
                )
        for child in (self.rowwise_quantizer, self.columnwise_quantizer):
            _OWNED_CHILDREN[id(child)] = child

    # A hybrid has a property when both children have it (requantization_safe) or either does.
    requantization_safe = property(lambda self: _children(self, all, "requantization_safe"))  # type: ignore[assignment]
    stochastic = property(lambda self: _children(self, any, "stochastic"))  # type: ignore[assignment]
    reduces_amax = property(lambda self: _children(self, any, "reduces_amax"))  # type: ignore[assignment]
    per_tensor_amax = property(lambda self: _children(self, any, "per_tensor_amax"))  # type: ignore[assignment]
    asks_amax_reduction = property(lambda self: _children(self, any, "asks_amax_reduction"))  # type: ignore[assignment]

    def child(self, direction: str) -> Quantizer:
        return self.rowwise_quantizer if direction == ROWWISE else self.columnwise_quantizer

    def for_direction(self, direction: str) -> Quantizer:
        return self.child(direction).for_direction(direction)

    def direction_spec(self, direction: str) -> str:
        child = self.for_direction(direction).spec
        if direction == COLUMNWISE and self.columnwise_source == "rowwise_dequantized":
            return f"{child} of rowwise_dequantized"
        return child

    def gemm_input(self, direction: str) -> Optional[GemmInput]:
        return self.child(direction).gemm_input(direction)

    def block(self, direction: str) -> tuple[int, int]:
        return self.child(direction).block(direction)

    def kernel_encoding(self, direction: str) -> Optional[KernelEncoding]:
        return self.child(direction).kernel_encoding(direction)

    def transposed(self, direction: str) -> bool:
        return self.child(direction).transposed(direction)

    def hadamard(self, direction: str) -> bool:
        return self.child(direction).hadamard(direction)

    def transform(self, direction: str) -> Optional[str]:
        return self.child(direction).transform(direction)

    def transformed(self, source: torch.Tensor, direction: str) -> torch.Tensor:
        return self.child(direction).transformed(source, direction)

    def scale_outer_major(self, direction: str) -> bool:
        return self.child(direction).scale_outer_major(direction)

    def columnwise_from_rowwise(self) -> bool:
        return self.columnwise_source == "rowwise_dequantized"

    def columnwise_is_rowwise_transposed(self) -> bool:
        return (
            self.columnwise_source == "original"
            and self.rowwise_quantizer == self.columnwise_quantizer
            and self.rowwise_quantizer.columnwise_is_rowwise_transposed()
        )

    def check_shape(self, shape: tuple[int, int], direction: str) -> None:
        if direction == COLUMNWISE and self.columnwise_source == "rowwise_dequantized":
            self.rowwise_quantizer.check_shape(shape, ROWWISE)
        self.child(direction).check_shape(shape, direction)

    def quantize_rowwise(self, x: torch.Tensor, ctx: QuantizeContext) -> Representation:
        return self.rowwise_quantizer.quantize_rowwise(x, ctx)

    def quantize_columnwise(self, x: torch.Tensor, ctx: QuantizeContext) -> Representation:
        return self.columnwise_quantizer.quantize_columnwise(self.columnwise_input(x, ctx), ctx)

    def columnwise_input(self, x: torch.Tensor, ctx: QuantizeContext) -> torch.Tensor:
        """What the columnwise child quantizes: x itself, or x through the rowwise child and back."""
        if self.columnwise_source == "original":
            return x
        return self.rowwise_quantizer.quantize_rowwise(x, ctx).dequantize(x.dtype)

    def dequantize(self, rep: Representation) -> torch.Tensor:
        return rep.quantizer.dequantize(rep)


def _children(hybrid: HybridQuantizer, combine, name: str) -> bool:
    """``combine`` (all or any) of the two children's ``name``."""
    return combine(getattr(child, name) for child in (hybrid.rowwise_quantizer, hybrid.columnwise_quantizer))
