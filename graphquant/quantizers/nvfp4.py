"""NVFP4: E2M1 elements, an E4M3 scale per 16 elements, and an FP32 global amax."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from graphquant.formats import nvfp4
from graphquant.formats.groups import group_amax, group_counters
from graphquant.quantizers.base import COLUMNWISE, ROWWISE, QuantizeContext, Quantizer, Representation
from graphquant.quantizers.descriptions import GemmInput, KernelEncoding

BLOCK_LEN = nvfp4.BLOCK_LEN


@dataclasses.dataclass(frozen=True)
class NVFP4Quantizer(Quantizer):
    """NVFP4 with TransformerEngine's two-level scale.

    with_2d_quantization: 16x16 tiles share one scale (the default for weights), so the
        columnwise codes are the transpose of the rowwise ones.
    with_rht / with_post_rht_amax: a random Hadamard transform on the columnwise side only
        (16-element chunks along the token dim), with the global amax taken after it. Both
        wgrad operands must carry the same transform; the planner checks this.
    stochastic_rounding: round to one of the two neighbouring E2M1 values with probability given
        by proximity, from a counter-based stream (seed, offset), so runs are reproducible.
    row_scaled_nvfp4: one global amax per row on the rowwise side (for forward activations).
    with_amax_reduction: each direction's global amax is all-reduced (MAX) over the recipe's
        process group (CustomRecipe.amax_reduction_group) before the scales are made from it.
    Columnwise data is stored transposed and packed: [cols, rows / 2].
    """

    tag = "nvfp4"
    groupable = True

    with_rht: bool = False
    with_post_rht_amax: bool = False
    with_2d_quantization: bool = False
    stochastic_rounding: bool = False
    row_scaled_nvfp4: bool = False
    with_random_sign_mask: bool = True
    with_amax_reduction: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.with_rht != self.with_post_rht_amax:
            raise ValueError(
                f"{self}: with_post_rht_amax must equal with_rht (the columnwise global amax is taken "
                "after the Hadamard transform exactly when there is one, as in TransformerEngine, whose "
                f"constructor takes both too); pass with_rht={self.with_rht}, with_post_rht_amax={self.with_rht}"
            )
        if self.row_scaled_nvfp4 and self.with_amax_reduction:
            raise ValueError(
                f"{self}: row_scaled_nvfp4 gives each row (token) an amax of its own, and rows on different ranks "
                "are different tokens, so there is no global amax to all-reduce; drop with_amax_reduction, or use a "
                "HybridQuantizer whose rowwise child is row-scaled and whose columnwise child reduces its amax"
            )

    @property
    def requantization_safe(self) -> bool:  # type: ignore[override]
        return not self.stochastic_rounding

    @property
    def stochastic(self) -> bool:  # type: ignore[override]
        return self.stochastic_rounding

    @property
    def reduces_amax(self) -> bool:  # type: ignore[override]
        return self.with_amax_reduction

    @property
    def per_tensor_amax(self) -> bool:  # type: ignore[override]
        return not self.row_scaled_nvfp4

    def block(self, direction: str) -> tuple[int, int]:
        if self.with_2d_quantization:
            return (BLOCK_LEN, BLOCK_LEN)
        return (1, BLOCK_LEN) if direction == ROWWISE else (BLOCK_LEN, 1)

    def hadamard(self, direction: str) -> bool:
        return self.with_rht and direction == COLUMNWISE

    def for_direction(self, direction: str) -> "NVFP4Quantizer":
        """Without the Hadamard transform's fields where ``direction`` has none (the rowwise side,
        which the forward GEMM and dgrad read, never has), and without row_scaled_nvfp4 on the
        columnwise side, whose global amax is the whole tensor's."""
        unused = set() if self.hadamard(direction) else {"with_rht", "with_post_rht_amax", "with_random_sign_mask"}
        if direction == COLUMNWISE:
            unused.add("row_scaled_nvfp4")
        return dataclasses.replace(self, **{f.name: f.default for f in dataclasses.fields(self) if f.name in unused})

    def transform(self, direction: str) -> Optional[str]:
        if not self.hadamard(direction):
            return None
        return f"the 16-point Hadamard transform {'with' if self.with_random_sign_mask else 'without'} its random sign mask"

    def transformed(self, source: torch.Tensor, direction: str) -> torch.Tensor:
        if not self.hadamard(direction):
            return source
        return nvfp4.hadamard_transform(source, random_sign_mask=self.with_random_sign_mask)

    def check_shape(self, shape: tuple[int, int], direction: str) -> None:
        """The dim a GEMM sums over in ``direction`` (1 rowwise, 0 columnwise) holds whole 16-element
        blocks; a 16x16 tile may end short along the other dim, its scale then taken over the rows
        there are (as zero rows would give it)."""
        dim = 1 if direction == ROWWISE else 0
        if shape[dim] % BLOCK_LEN:
            rows, cols = self.block(direction)
            raise ValueError(
                f"{self}: the {direction} representation has {rows}x{cols} blocks, {BLOCK_LEN} elements along dim {dim}, "
                f"which a GEMM sums over, so dim {dim} of the {shape[0]}x{shape[1]} tensor must be a multiple of {BLOCK_LEN} "
                f"(got {shape[dim]}); NVFP4 does not pad"
            )

    def _encode(self, x: torch.Tensor, direction: str, ctx: QuantizeContext, amax: Optional[torch.Tensor] = None) -> Representation:
        columnwise = direction == COLUMNWISE
        source = self.transformed(x.t() if columnwise else x, direction)
        if amax is None and self.with_amax_reduction:
            amax = ctx.reduced_amax(nvfp4.global_amax(source))
        data, scale, amax = nvfp4.quantize(
            source,
            tile_rows=BLOCK_LEN if self.with_2d_quantization else 1,
            row_scaled=self.row_scaled_nvfp4 and not columnwise,
            rng=(*ctx.random_stream(), int(columnwise)) if self.stochastic_rounding else None,
            amax=amax,
        )
        return self.representation(direction, x.shape, x.dtype, data, scale, amax)

    def quantize_groups(
        self, x: torch.Tensor, row_group: torch.Tensor, groups: int, direction: str, ctx: QuantizeContext
    ) -> Representation:
        """A global amax per group (of the transformed values, with the Hadamard transform; each
        all-reduced with with_amax_reduction), given to each block as its group's: amax (groups,).
        Row-scaled rows have their own.
        Stochastic rounding draws each group's numbers as the group's part of the layout alone
        would (``group_counters``), from ctx's stream."""
        columnwise = direction == COLUMNWISE
        row_scaled = self.row_scaled_nvfp4 and not columnwise
        source = self.transformed(x.t() if columnwise else x, direction)
        group_amaxes = block_amax = None
        if not row_scaled:
            group_amaxes = group_amax(source.t() if columnwise else source, row_group, groups)
            if self.with_amax_reduction:
                group_amaxes = ctx.reduced_amax(group_amaxes)
            # Blocks run along the grouped rows in the transposed columnwise data: one amax a block.
            block_amax = group_amaxes[row_group[::BLOCK_LEN]][None, :] if columnwise else group_amaxes[row_group, None]
        tile_rows = BLOCK_LEN if self.with_2d_quantization else 1
        rng = rng_index = None
        if self.stochastic_rounding:
            rng = (*ctx.random_stream(), int(columnwise))
            rng_index = group_counters(row_group, groups, x.shape[1], transposed=columnwise)
        data, scale, amax = nvfp4.quantize(
            source, tile_rows=tile_rows, row_scaled=row_scaled, rng=rng, amax=block_amax, rng_index=rng_index
        )
        return self.representation(direction, x.shape, x.dtype, data, scale, amax if row_scaled else group_amaxes)

    def grouped_factor(self, rep: Representation, row_group: torch.Tensor) -> torch.Tensor:
        factor = nvfp4.global_decode(rep.amax)
        if rep.direction == COLUMNWISE:
            return factor[:, None]
        return factor[:, None] if self.row_scaled_nvfp4 else factor[row_group, None]

    def grouped_columnwise_amax(self, x: torch.Tensor, row_group: torch.Tensor, groups: int) -> torch.Tensor:
        """Of the transformed values, where the columnwise has the Hadamard transform."""
        return group_amax(self.transformed(x.t(), COLUMNWISE).t(), row_group, groups)

    def quantize_rowwise(self, x: torch.Tensor, ctx: QuantizeContext) -> Representation:
        return self._encode(x, ROWWISE, ctx)

    def quantize_from_amax(self, x: torch.Tensor, amax: torch.Tensor, direction: str) -> Representation:
        """x in ``direction`` encoded from a global ``amax`` taken where x was made (shaped as
        nvfp4.global_amax gives it, of the transformed values where there is a transform)."""
        if self.stochastic_rounding:
            raise ValueError(f"{self}: stochastic rounding draws from a slot's random stream, which quantize_from_amax has none of")
        return self._encode(x, direction, QuantizeContext(), amax)

    def quantize_columnwise(self, x: torch.Tensor, ctx: QuantizeContext) -> Representation:
        return self._encode(x, COLUMNWISE, ctx)

    def transposed(self, direction: str) -> bool:
        return direction == COLUMNWISE

    def dequantize(self, rep: Representation) -> torch.Tensor:
        return nvfp4.dequantize(rep.data, rep.scale, rep.amax)

    def gemm_input(self, direction: str) -> GemmInput:
        row_scaled = self.row_scaled_nvfp4 and direction == ROWWISE
        return GemmInput("nvfp4_row_scaled" if row_scaled else "nvfp4", "e2m1")

    def kernel_encoding(self, direction: str) -> KernelEncoding:
        return KernelEncoding(
            "nvfp4",
            "e2m1",
            block=self.block(direction),
            transposed=self.transposed(direction),
            hadamard=self.hadamard(direction),
            random_sign_mask=self.hadamard(direction) and self.with_random_sign_mask,
            stochastic_rounding=self.stochastic_rounding,
            row_scaled=self.row_scaled_nvfp4 and direction == ROWWISE,
        )

    def emulated_values(self, rep: Representation) -> torch.Tensor:
        return nvfp4.e2m1_values(nvfp4.unpack(rep.data)) * rep.scale.float().repeat_interleave(BLOCK_LEN, dim=1)

    def emulated_factor(self, rep: Representation) -> torch.Tensor:
        factor = nvfp4.global_decode(rep.amax)
        return factor.reshape(-1, 1) if factor.dim() else factor

    def values_exact_in_bf16(self, rep: Representation) -> bool:
        return True  # E2M1 times E4M3: at most 6 significant bits

    def at_largest_code(self, rep: Representation) -> torch.Tensor:
        return (nvfp4.unpack(rep.data) & 0x7) == 0x7  # the E2M1 code of 6.0
