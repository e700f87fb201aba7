"""FP8 with one FP32 scale per 1x128 block (128x1 columnwise) or per 128x128 tile."""

from __future__ import annotations

import dataclasses
import functools

import torch

from graphquant.formats import block
from graphquant.quantizers.base import COLUMNWISE, ROWWISE, QuantizeContext, Quantizer, Representation
from graphquant.quantizers.descriptions import GemmInput, KernelEncoding
from graphquant.quantizers.float8 import normalize_fp8_dtype, traced_scales

BLOCK_LEN = 128


@dataclasses.dataclass(frozen=True)
class Float8BlockQuantizer(Quantizer):
    """DeepSeek-style blockwise FP8.

    block_scaling_dim=1: 1x128 blocks along the row (rowwise) and 128x1 along the column
    (columnwise); the two directions are different numbers. block_scaling_dim=2: 128x128 tiles
    shared by both directions, so columnwise is the exact transpose of rowwise. Partial blocks at
    the edges are allowed. Columnwise data is stored transposed, as Hopper's TN GEMM reads it.
    """

    tag = "fp8_block"
    traceable = True
    groupable = True
    block_local_scales = True
    always_shown = ("fp8_dtype", "block_scaling_dim")

    fp8_dtype: str = "e4m3"
    block_scaling_dim: int = 2
    amax_epsilon: float = 0.0
    force_pow_2_scales: bool = True

    def __post_init__(self) -> None:
        normalize_fp8_dtype(self)
        super().__post_init__()
        if self.block_scaling_dim not in (1, 2):
            raise ValueError(f"Float8BlockQuantizer.block_scaling_dim must be 1 or 2, got {self.block_scaling_dim}")

    def block(self, direction: str) -> tuple[int, int]:
        if self.block_scaling_dim == 2:
            return (BLOCK_LEN, BLOCK_LEN)
        return (1, BLOCK_LEN) if direction == ROWWISE else (BLOCK_LEN, 1)

    def _encode(self, x: torch.Tensor, direction: str) -> Representation:
        transposed = self.transposed(direction)
        source = x.t() if transposed else x
        rows, cols = self.block(ROWWISE) if self.block_scaling_dim == 1 else self.block(direction)
        data, scale_inv = block.quantize(
            source,
            self.fp8_dtype,
            block=(rows, cols),
            epsilon=self.amax_epsilon,
            pow2=self.force_pow_2_scales,
            scales=functools.partial(traced_scales, blocks_in_rows=rows == 1),
        )
        return self.representation(direction, x.shape, x.dtype, data, scale_inv)

    def quantize_rowwise(self, x: torch.Tensor, ctx: QuantizeContext) -> Representation:
        return self._encode(x, ROWWISE)

    def quantize_columnwise(self, x: torch.Tensor, ctx: QuantizeContext) -> Representation:
        return self._encode(x, COLUMNWISE)

    def transposed(self, direction: str) -> bool:
        return direction == COLUMNWISE

    def scale_outer_major(self, direction: str) -> bool:
        return self.block_scaling_dim == 1

    def dequantize(self, rep: Representation) -> torch.Tensor:
        rows = 1 if self.block_scaling_dim == 1 else BLOCK_LEN
        return block.dequantize(rep.data, rep.scale, block=(rows, BLOCK_LEN))

    def gemm_input(self, direction: str) -> GemmInput:
        return GemmInput("fp8_block_1x128" if self.block_scaling_dim == 1 else "fp8_block_128x128", self.fp8_dtype)

    def values_exact_in_bf16(self, rep: Representation) -> bool:
        return self.force_pow_2_scales  # FP8 codes times powers of two

    def kernel_encoding(self, direction: str) -> KernelEncoding:
        return KernelEncoding(
            "block",
            self.fp8_dtype,
            block=self.block(direction),
            transposed=self.transposed(direction),
            amax_epsilon=self.amax_epsilon,
            pow2_scales=self.force_pow_2_scales,
        )
