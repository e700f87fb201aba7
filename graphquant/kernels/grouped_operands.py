"""How an FP8 grouped representation's codes and scales lie for a grouped GEMM kernel
(graphquant.kernels.triton_grouped_fp8, graphquant.kernels.grouped_fp8): the format's layout,
read once here, so that each kernel takes plain strides."""

from __future__ import annotations

from typing import NamedTuple

import torch

from graphquant.quantizers import ROWWISE, Representation

SCALE_BLOCK = 128  # the K extent of a block scale, and the rows of a 128x128 one
ROW_SCALED = ("fp8_tensorwise", "fp8_rowwise")  # the families whose factors are one a GEMM row (or tensor)
_FP8 = ("e4m3", "e5m2")
ELEMENT_PAIRS = frozenset((x, y) for x in _FP8 for y in _FP8)  # FP8 codes of either element on either side


class Scales(NamedTuple):
    """Where an operand's scales lie: the scale of its GEMM row i (in group g) and K block kb is at
    ``tensor + g * group + (i // rows) * row + kb * block``. A per-tensor or per-row factor has
    block 0 (applied once, after the sum); a block scale's rows are 1 or 128."""

    tensor: torch.Tensor
    group: int
    row: int
    block: int
    rows: int = 1


def block_scaled(rep: Representation) -> bool:
    """Whether its scales are per K block (DeepSeek-V3's FP8 blocks, MXFP8), not per row or tensor."""
    family = rep.quantizer.gemm_input(rep.direction).family
    return family.startswith("fp8_block") or family == "mxfp8"


def mx(rep: Representation) -> bool:
    """Whether its block scales are MXFP8's E8M0 exponents of 32-long blocks."""
    return rep.quantizer.gemm_input(rep.direction).family == "mxfp8"


def scale_rows(rep: Representation) -> int:
    """The GEMM rows one block scale covers: 128 for 128x128 tiles, 1 for 1x128 blocks (both
    directions: a columnwise 128x1 block is a 1x128 one of the stored transpose)."""
    return SCALE_BLOCK if rep.quantizer.gemm_input(rep.direction).family == "fp8_block_128x128" else 1


def e5m2(rep: Representation) -> bool:
    """Whether its FP8 codes are E5M2 (else E4M3)."""
    return rep.quantizer.gemm_input(rep.direction).element == "e5m2"


def codes(rep: Representation) -> torch.Tensor:
    """The FP8 codes typed as their element, so that the tensor cores read them straight from
    the shared memory the loads fill (bytes would be cast in registers and stored back first)."""
    return rep.data.view(torch.float8_e5m2 if e5m2(rep) else torch.float8_e4m3fn)


def expert_scales(b: Representation, b_group: torch.Tensor, groups: int) -> Scales:
    """B's scales for tokens x experts: B_g's GEMM rows are the output columns. Rowwise data
    (groups * n', k) has group g's rows from g * n' on; columnwise data (cols, groups * n'),
    stored transposed, group g's K from g * n' on."""
    per_group = (b.data.shape[0] if b.direction == ROWWISE else b.data.shape[1]) // groups
    if block_scaled(b):
        rows = scale_rows(b)
        row, block = b.scale.stride()
        group = per_group // rows * row if b.direction == ROWWISE else per_group // SCALE_BLOCK * block
        return Scales(b.scale, group, row, block, rows)
    factor = b.quantizer.grouped_factor(b, b_group).float()
    if b.direction == ROWWISE:  # (groups * n', 1): one per row of the stack
        return Scales(factor, per_group * factor.stride(0), factor.stride(0), 0)
    factor = factor.expand(groups, b.data.shape[0])  # (groups, cols or 1): one per column of each group
    return Scales(factor, factor.stride(0), factor.stride(1), 0)


def token_scales(rep: Representation, row_group: torch.Tensor, groups: int) -> Scales:
    """The scales of a token operand: rowwise (tokens x experts' A), its rows; columnwise
    (either side of tokens x tokens), its columns in each group."""
    if block_scaled(rep):
        row, block = rep.scale.stride()
        return Scales(rep.scale, 0, row, block, scale_rows(rep))
    factor = rep.quantizer.grouped_factor(rep, row_group).float()
    if rep.direction == ROWWISE:
        return Scales(factor, 0, factor.stride(0), 0)
    factor = factor.expand(groups, rep.data.shape[0])
    return Scales(factor, factor.stride(0), factor.stride(1), 0)
