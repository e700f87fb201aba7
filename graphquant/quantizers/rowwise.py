"""FP8 with one FP32 scale per row (rowwise) or per column (columnwise): torchao's "rowwise"."""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from graphquant.formats import block, fp8
from graphquant.formats.groups import group_amax
from graphquant.quantizers.base import COLUMNWISE, ROWWISE, QuantizeContext, Quantizer, Representation
from graphquant.quantizers.descriptions import GemmInput, KernelEncoding
from graphquant.quantizers.float8 import normalize_fp8_dtype, traced_scales


@dataclasses.dataclass(frozen=True)
class Float8RowwiseQuantizer(Quantizer):
    """Per-row FP8: each row of the GEMM operand has its own scale along the whole reduction dim.

    The rowwise representation scales each row; the columnwise one each column, stored
    transposed, so it too scales each row of the operand its GEMM reads. The scale rule is
    current scaling's, per row; force_pow_2_scales (the torchao default) rounds it down.
    """

    tag = "fp8_rowwise"
    traceable = True
    groupable = True
    always_shown = ("fp8_dtype",)

    fp8_dtype: str = "e4m3"
    force_pow_2_scales: bool = True
    amax_epsilon: float = 0.0

    def __post_init__(self) -> None:
        normalize_fp8_dtype(self)
        super().__post_init__()

    def block(self, direction: str) -> tuple[int, int]:
        return (-1, 1) if direction == COLUMNWISE else (1, -1)

    def transposed(self, direction: str) -> bool:
        return direction == COLUMNWISE

    def _encode(self, x: torch.Tensor, direction: str) -> Representation:
        source = x.t() if self.transposed(direction) else x
        length = source.shape[1]
        if not statically_known_true(length != 0):
            # A row of no values still has its scale (a wgrad operand of an expert no token reached):
            # rows that may be empty, where a data-dependent op chose the length, get a zero each.
            source = torch.nn.functional.pad(source, (0, 1))
        data, scale_inv = block.quantize(
            source,
            self.fp8_dtype,
            block=(1, source.shape[1]),
            epsilon=self.amax_epsilon,
            pow2=self.force_pow_2_scales,
            scales=functools.partial(traced_scales, blocks_in_rows=True),
        )
        return self.representation(direction, x.shape, x.dtype, data[:, :length], scale_inv)

    def quantize_rowwise(self, x: torch.Tensor, ctx: QuantizeContext) -> Representation:
        return self._encode(x, "rowwise")

    def quantize_columnwise(self, x: torch.Tensor, ctx: QuantizeContext) -> Representation:
        return self._encode(x, COLUMNWISE)

    def quantize_groups(
        self, x: torch.Tensor, row_group: torch.Tensor, groups: int, direction: str, ctx: QuantizeContext
    ) -> Representation:
        """Rowwise scales never span groups; columnwise ones are per column of each group:
        scale (groups, cols, 1), each group's (cols, 1) as quantize_columnwise makes it."""
        if direction == ROWWISE:
            return self.quantize_rowwise(x, ctx)
        amax = group_amax(x, row_group, groups, per_column=True)
        scale, scale_inv = traced_scales(amax, self.fp8_dtype, self.amax_epsilon, self.force_pow_2_scales)
        data = fp8.cast_to_fp8(x.float() * scale[row_group], self.fp8_dtype).t().contiguous()
        return self.representation(direction, x.shape, x.dtype, data, scale_inv[:, :, None])

    def grouped_factor(self, rep: Representation, row_group: torch.Tensor) -> torch.Tensor:
        return rep.scale.reshape(-1, 1) if rep.direction == ROWWISE else rep.scale[:, :, 0]

    def grouped_columnwise_amax(self, x: torch.Tensor, row_group: torch.Tensor, groups: int) -> torch.Tensor:
        return group_amax(x, row_group, groups, per_column=True).reshape(-1)

    def dequantize(self, rep: Representation) -> torch.Tensor:
        return block.dequantize(rep.data, rep.scale, block=(1, rep.data.shape[1]))

    def gemm_input(self, direction: str) -> GemmInput:
        return GemmInput("fp8_rowwise", self.fp8_dtype)

    def emulated_values(self, rep: Representation) -> torch.Tensor:
        return rep.data  # the FP8 codes, no copy

    def emulated_factor(self, rep: Representation) -> torch.Tensor:
        return rep.scale.reshape(-1, 1)

    def values_exact_in_bf16(self, rep: Representation) -> bool:
        return True

    def kernel_encoding(self, direction: str) -> KernelEncoding:
        return KernelEncoding(
            "row",
            self.fp8_dtype,
            block=self.block(direction),
            transposed=self.transposed(direction),
            amax_epsilon=self.amax_epsilon,
            pow2_scales=self.force_pow_2_scales,
        )
