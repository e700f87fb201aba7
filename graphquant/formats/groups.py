"""Row groups (MoE experts) of one tensor, laid out so that every group can be quantized alone.

A grouped tensor's rows belong to groups given by their cumulative ends (``offs``, on the
device, as torch._grouped_mm takes them). To quantize each group as if it were alone in one pass
over the whole tensor, the rows are copied into a padded layout where every group starts at a
multiple of ``block`` rows and is followed by zero rows up to the next multiple: then no scale
block along the rows spans two groups, and a block that a group fills only partly holds zeros
where the group has no rows. That is exactly what quantizing the group alone, zero-padded to
whole blocks, gives (zeros raise no amax; a format that allows partial blocks treats the missing
rows as zeros too), and empty groups take no rows at all. Quantities a format takes over a whole
tensor (a per-tensor scale, NVFP4's global amax, a per-column scale) are taken per group
(``group_amax``).

The padded row count is a static bound, so every shape here is known without reading ``offs``
on the host: nothing waits for the device.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from graphquant.formats.fp8 import magnitude_bits

# Rows every group is padded to a multiple of: TE's quantization_alignment, whole blocks of every
# format, whole tiles of the native grouped quantize, and aligned rows for torch._grouped_mm.
GROUP_ROWS = 128
# Rows a graph that runs fprop alone pads each group of tokens to, where its rowwise format allows
# (graphquant.kernels.backends.token_rows) and the tokens are few, at most FEW_TOKENS_AN_EXPERT routed
# rows an expert on average: one tile of the few-token programs (the decoding programs', the FP8
# grouped kernel's), and torch._scaled_grouped_mm's alignment. A decode step's few tokens an expert
# are then quantized and multiplied in 16 rows, not 128; more keep 128-row tiles, which read each
# expert's weights once for up to 128 of its tokens. FEW_TOKENS_AN_EXPERT is also the most the
# decoding programs' 16-token tiles take (triton_decode.TILED_ROWS_AN_EXPERT).
FEW_TOKEN_ROWS = 16
FEW_TOKENS_AN_EXPERT = 32


def token_block(few_rows: int, rows: int, groups: int) -> int:
    """The rows each group of ``rows`` rows (tokens) among ``groups`` starts at a multiple of:
    ``few_rows`` (a grouped site's Site.token_rows) where they are few, FEW_TOKENS_AN_EXPERT a
    group on average, else GROUP_ROWS."""
    return few_rows if rows <= FEW_TOKENS_AN_EXPERT * groups else GROUP_ROWS


class GroupPadding(NamedTuple):
    """Where the rows of a grouped tensor go in its padded layout.

    position: (rows,) int64, the padded row of each row.
    row_group: (padded_rows,) int64, the group of each padded row (pad rows: the group they
        follow; rows after the last group: the last group, all of them zeros).
    ends: (groups,) int32, the cumulative padded ends of the groups (torch._grouped_mm's offs
        for the padded layout).
    source: (padded_rows,) int64, the row each padded row holds, -1 for a pad row (position's
        inverse: padding is a gather, which a compiler fuses with what makes x).
    row_ends: (groups,) int32, the cumulative ends of the groups' rows themselves, unpadded
        (the offs the layout was made from: torch._grouped_mm's offs for the rows as they are).
    """

    position: torch.Tensor
    row_group: torch.Tensor
    ends: torch.Tensor
    source: torch.Tensor
    row_ends: torch.Tensor

    @property
    def groups(self) -> int:
        return self.ends.shape[0]

    @property
    def padded_rows(self) -> int:
        return self.row_group.shape[0]

    @property
    def gather(self) -> Optional[torch.Tensor]:
        """``source`` where the layout has pad rows; None where no group needs padding (as many
        padded rows as rows: an expert stack of whole blocks), whose rows are the layout's."""
        return None if self.padded_rows == self.position.shape[0] else self.source

    @property
    def runs(self) -> Optional[torch.Tensor]:
        """``gather``'s tile_runs of GROUP_ROWS rows, as the native grouped quantize reads x's
        rows (None with gather): made beside the layout, where a compiler fuses them with it."""
        return None if self.gather is None else tile_runs(self.source, GROUP_ROWS)

    @property
    def bounds(self) -> torch.Tensor:
        """(groups + 1) int64: each group's first padded row, then the padded rows, the zero rows
        after the last group counted as its (they are quantized with it, so that the groups cover
        every padded row). Made beside the layout, where a compiler fuses it with it, for the
        native grouped quantize to read as it is."""
        return torch.cat([self.ends.new_zeros(1), self.ends[:-1], self.ends.new_full((1,), self.padded_rows)]).long()

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """x (rows, cols) in the padded layout, zeros between the groups (x itself where no
        group needs padding)."""
        return x if self.gather is None else gather_rows(x, self.source)


def gather_rows(x: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """(len(source), cols): row r is x[source[r]], zeros where source[r] is -1."""
    if x.shape[0] == 0:  # nothing to gather from
        return x.new_zeros((source.shape[0], x.shape[1]))
    held = source >= 0
    return torch.where(held[:, None], x[source.clamp_min(0)], torch.zeros((), dtype=x.dtype, device=x.device))


def tile_runs(source: torch.Tensor, tile: int) -> torch.Tensor:
    """A padded layout's tiles of ``tile`` rows (``source``: a GroupPadding's, its groups starting
    at multiples of ``tile``): (tiles, 2) int32, the row of x each tile's first row holds and how
    many rows of x the tile holds, a run of x's rows before its zero rows (0 and 0: none)."""
    tiles = source.view(-1, tile)
    return torch.stack([tiles[:, 0].clamp_min(0), (tiles >= 0).sum(1)], 1).to(torch.int32)


def padded_bound(rows: int, groups: int, block: int) -> int:
    """The most rows ``rows`` rows in ``groups`` groups take once each group is padded to
    ``block`` rows: every group that holds a row may leave up to block - 1 rows unfilled, and no
    more groups than rows hold one (a decode step's 8 routed rows among 64 experts: 1024 rows, not
    8192)."""
    return -(-(rows + max(min(rows, groups), 1) * (block - 1)) // block) * block  # no rows: one block still


def padding(offs: torch.Tensor, rows: int, block: int, padded_rows: int) -> GroupPadding:
    """The padded layout of ``rows`` rows with cumulative group ends ``offs`` (int, on the
    device), each group starting at a multiple of ``block``, in ``padded_rows`` rows (at least
    ``padded_bound``). Vectorised, so ``offs`` stays on the device."""
    ends = offs.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    padded_sizes = (ends - starts + block - 1) // block * block
    padded_ends = torch.cumsum(padded_sizes, 0)
    padded_starts = padded_ends - padded_sizes
    row = torch.arange(rows, device=offs.device)
    group = torch.searchsorted(ends, row, right=True).clamp_max(offs.shape[0] - 1)
    position = row - starts[group] + padded_starts[group]
    padded_row = torch.arange(padded_rows, device=offs.device)
    row_group = torch.searchsorted(padded_ends, padded_row, right=True).clamp_max(offs.shape[0] - 1)
    within = padded_row - padded_starts[row_group]
    source = torch.where(within < ends[row_group] - starts[row_group], starts[row_group] + within, -1)
    return GroupPadding(position, row_group, padded_ends.to(torch.int32), source, offs.to(torch.int32))


def uniform_padding(groups: int, rows: int, block: int, device: torch.device) -> GroupPadding:
    """``padding`` of ``groups`` groups of ``rows`` rows each (an expert stack's), in closed form:
    every group's padded rows are ``rows`` rounded up to ``block``, so no search places a row, and
    a compiler fuses the layout into what reads it instead of running searches at every call."""
    padded = -(-rows // block) * block
    row = torch.arange(groups * rows, device=device)
    padded_row = torch.arange(groups * padded, device=device)
    row_group, within = padded_row // padded, padded_row % padded
    source = torch.where(within < rows, row_group * rows + within, -1)
    ends = torch.arange(1, groups + 1, dtype=torch.int32, device=device)
    return GroupPadding(row + row // rows * (padded - rows), row_group, ends * padded, source, ends * rows)


_ASSERT_MESSAGE_LENGTH = 254


def check_offsets(offs: torch.Tensor, rows: int, what: str) -> None:
    """Fail (asynchronously on a GPU: no host wait) unless ``offs`` is non-decreasing and ends at
    ``rows``: every row in a group (torch._grouped_mm leaves rows past the last offset unwritten
    and fails in their backward)."""
    ends = offs.long()
    ordered = torch.all(ends[1:] >= ends[:-1]) & (ends[0] >= 0) & (ends[-1] == rows)
    count = f"{rows} rows" if isinstance(rows, int) else "rows"
    message = (
        f"the grouped GEMM's offsets must be non-decreasing and end at the input's {count} (rows past offs[-1] stay "
        "unwritten); slice the input to offs[-1] rows, or route the padding rows to an expert"
    )
    # CUDA's device-side assert takes a message under 255 characters: a long site name is cut.
    torch._assert_async(ordered, f"{what[: _ASSERT_MESSAGE_LENGTH - len(message) - 2]}: {message}")


def gather_index(index: torch.Tensor, rows: int, what: str) -> torch.Tensor:
    """``index`` (x[index] of an x of ``rows`` rows) as int64 rows of x, negative ones counted from
    the end as indexing counts them; failing (asynchronously on a GPU) where one lies outside
    [-rows, rows), as indexing fails, rather than read past x."""
    index = index.long()
    message = f"a gather's index must lie in [-{rows}, {rows}), the rows of what it indexes"
    torch._assert_async(torch.all((index >= -rows) & (index < rows)), f"{what[: _ASSERT_MESSAGE_LENGTH - len(message) - 2]}: {message}")
    return torch.where(index < 0, index + rows, index)


def group_counters(row_group: torch.Tensor, groups: int, cols: int, *, transposed: bool = False) -> torch.Tensor:
    """The linear index of every element of x (padded_rows, cols) within its group's part of the
    layout (its rows and the zero rows after it, up to the next group's start or the layout's
    end) taken alone, row-major: (padded_rows, cols) int64; with ``transposed``, of that part's
    transpose, laid out as x^T (cols, padded_rows). The counters of a format's random draws,
    so that every group draws what it would alone, whatever the other groups hold."""
    sizes = row_group.new_zeros(groups).index_add_(0, row_group, torch.ones_like(row_group))  # static shape, unlike bincount
    starts = torch.cumsum(sizes, 0) - sizes
    row = torch.arange(row_group.shape[0], device=row_group.device) - starts[row_group]
    col = torch.arange(cols, device=row_group.device)
    if transposed:
        return col[:, None] * sizes[row_group][None, :] + row[None, :]
    return row[:, None] * cols + col[None, :]


def group_amax(x: torch.Tensor, row_group: torch.Tensor, groups: int, *, per_column: bool = False) -> torch.Tensor:
    """max |x| over each group's rows of x (padded_rows, cols), fp32: (groups,), or with
    ``per_column`` (groups, cols). Exact and NaN-propagating, as ``fp8.tensor_amax`` (a max of
    magnitude bit patterns); an empty group's amax is 0, as an empty tensor's."""
    bits = magnitude_bits(x)
    if per_column:
        index = row_group[:, None].expand_as(bits)
        out = bits.new_zeros((groups, x.shape[1]))
    else:
        bits, index = bits.amax(1), row_group
        out = bits.new_zeros(groups)
    return out.scatter_reduce(0, index, bits, "amax").view(torch.float32)
