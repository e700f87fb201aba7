"""MXFP8: FP8 elements with one E8M0 (power-of-two) scale per 32 elements."""

from __future__ import annotations

import dataclasses

import torch

from graphquant.formats import mxfp8
from graphquant.quantizers.base import COLUMNWISE, ROWWISE, QuantizeContext, Quantizer, Representation
from graphquant.quantizers.descriptions import GemmInput, KernelEncoding
from graphquant.quantizers.float8 import normalize_fp8_dtype

BLOCK_LEN = mxfp8.BLOCK_LEN


@dataclasses.dataclass(frozen=True)
class MXFP8Quantizer(Quantizer):
    """MXFP8 as TransformerEngine computes it.

    Rowwise: 1x32 blocks along the row; columnwise: 32x1 blocks along the column, from the same
    source, so the two directions are different numbers. Columnwise data keeps the logical
    (not transposed) layout. Scales are rounded up to a power of two, so nothing clips; rowwise
    ones lie outer-dim-major (a (M, K/32) view of (K/32, M) memory). The blocked dimension must
    be a multiple of 32.
    """

    attention_format = True

    tag = "mxfp8"
    traceable = True
    block_local_scales = True
    groupable = True
    always_shown = ("fp8_dtype",)

    fp8_dtype: str = "e4m3"

    def __post_init__(self) -> None:
        normalize_fp8_dtype(self)
        super().__post_init__()

    def block(self, direction: str) -> tuple[int, int]:
        return (1, BLOCK_LEN) if direction == ROWWISE else (BLOCK_LEN, 1)

    def check_shape(self, shape: tuple[int, int], direction: str) -> None:
        dim = 1 if direction == ROWWISE else 0
        if shape[dim] % BLOCK_LEN:
            raise ValueError(
                f"{self}: the {direction} representation has {self.block(direction)[0]}x"
                f"{self.block(direction)[1]} blocks, so dim {dim} of the {shape[0]}x{shape[1]} tensor "
                f"must be a multiple of {BLOCK_LEN} (got {shape[dim]}); MXFP8 does not pad"
            )

    def _encode(self, x: torch.Tensor, direction: str) -> Representation:
        axis = 1 if direction == ROWWISE else 0
        data, scale = mxfp8.quantize(x, self.fp8_dtype, axis=axis, scales=torch.ops.graphquant.e8m0_scales)
        return self.representation(direction, x.shape, x.dtype, data, scale)

    def quantize_rowwise(self, x: torch.Tensor, ctx: QuantizeContext) -> Representation:
        return self._encode(x, ROWWISE)

    def quantize_columnwise(self, x: torch.Tensor, ctx: QuantizeContext) -> Representation:
        return self._encode(x, COLUMNWISE)

    def scale_outer_major(self, direction: str) -> bool:
        return direction == ROWWISE

    def dequantize(self, rep: Representation) -> torch.Tensor:
        return mxfp8.dequantize(rep.data, rep.scale, axis=1 if rep.direction == ROWWISE else 0)

    def gemm_input(self, direction: str) -> GemmInput:
        return GemmInput("mxfp8", self.fp8_dtype)

    def values_exact_in_bf16(self, rep: Representation) -> bool:
        return True  # FP8 codes times powers of two

    def kernel_encoding(self, direction: str) -> KernelEncoding:
        return KernelEncoding("mxfp8", self.fp8_dtype, block=self.block(direction))
