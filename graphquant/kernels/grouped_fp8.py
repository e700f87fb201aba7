"""The promoted FP8 grouped GEMMs of an MoE layer's experts on Hopper by graphquant's own kernel,
graphquant._C.grouped_fp8_tokens_by_experts / _tokens_by_tokens (csrc/cuda/grouped_gemm.cu).

The products, layouts and numerics of graphquant.kernels.triton_grouped_fp8, whose functions these
mirror, for sums promoted into fp32: per-tensor and per-row scales every 128 products, DeepSeek-V3's
block scales (1x128 by 128x128 in fprop and dgrad, 1x128 by 1x128 in wgrad). The Triton kernel
waits for each K tile's wgmmas before promoting them; this one is persistent, a warpgroup copying
the operands by TMA while two multiply 128 x 256 tiles, so one warpgroup's promotion runs beside
the other's products. It takes groups of whole 128-row tiles (formats.groups.GROUP_ROWS). Its
promoted products run faster than the Triton kernel's even where those leave the sums in the
tensor cores' accumulator (benchmarks/NOTES.md, grouped_gemm.py), so the plan gives it the GEMMs a
recipe lets accumulate fast too (backends.WGMMA_GROUPED_GEMM).
"""

from __future__ import annotations

import itertools
from typing import Optional

import torch

from graphquant.formats import fp8
from graphquant.formats.groups import GROUP_ROWS, GroupPadding
from graphquant.kernels import grouped_operands as operands
from graphquant.kernels import native
from graphquant.quantizers import ROWWISE, Representation

BACKEND = "wgmma fp8 grouped gemm"
FAMILY_PAIRS = frozenset(
    {*itertools.product(operands.ROW_SCALED, repeat=2), ("fp8_block_1x128", "fp8_block_128x128"), ("fp8_block_1x128", "fp8_block_1x128")}
)
ELEMENT_PAIRS = operands.ELEMENT_PAIRS
K_MULTIPLE = 16  # TMA reads rows of whole 16 bytes
PROMOTE_EVERY = fp8.PROMOTED_PRODUCTS  # one 128-long K block a promotion
# The kernel's modes: per-tensor or per-row factors after the sum; block scales in it, B's 128x128 or 1x128.
PROMOTED, BLOCK, BLOCK_COLUMNS = 1, 2, 3


def extension_runs(device: torch.device) -> bool:
    """Whether graphquant's extension runs the kernel on ``device`` (built for its sm_90: sm_90a, wgmma)."""
    return native.has_sm90_kernel(native.extension_for(device), "grouped_fp8_tokens_by_experts")


def _mode(a: Representation, b: Representation, promote_every: Optional[int]) -> int:
    if promote_every != PROMOTE_EVERY:
        raise ValueError(f"{BACKEND} promotes its sums every {PROMOTE_EVERY} products, not every {promote_every}")
    if not operands.block_scaled(a):
        return PROMOTED
    return BLOCK if operands.scale_rows(b) == operands.SCALE_BLOCK else BLOCK_COLUMNS


def tokens_by_experts(
    a: Representation, b: Representation, b_group: torch.Tensor, tokens: GroupPadding, token_rows: int, n: int,
    out_dtype: torch.dtype, promote_every: Optional[int],
) -> torch.Tensor:
    """(tokens, n): row t is A's padded row tokens.position[t] times its group's B, as
    triton_grouped_fp8.tokens_by_experts, its groups starting at multiples of ``token_rows``,
    which must be GROUP_ROWS, its sums promoted every ``promote_every`` (PROMOTE_EVERY) products."""
    if token_rows != GROUP_ROWS:
        raise ValueError(f"{BACKEND} multiplies groups of tokens that start at multiples of {GROUP_ROWS} rows, not {token_rows}")
    groups = tokens.groups
    sa, sb = operands.token_scales(a, tokens.row_group, groups), operands.expert_scales(b, b_group, groups)
    return native.extension_for(a.data.device).grouped_fp8_tokens_by_experts(
        operands.codes(a), operands.codes(b), b.direction == ROWWISE, n, tokens.position.shape[0], tokens.row_group, tokens.source,
        tokens.ends, sa.tensor, list(sa[1:]), sb.tensor, list(sb[1:]), _mode(a, b, promote_every), out_dtype,
    )


def tokens_by_tokens(
    a: Representation, a_group: torch.Tensor, b: Representation, b_group: torch.Tensor, ends: torch.Tensor, m: int,
    out_dtype: torch.dtype, promote_every: Optional[int],
) -> torch.Tensor:
    """(groups, m, cols of B): A_g^T B_g for each group g, as triton_grouped_fp8.tokens_by_tokens
    (per-tensor and per-row scales, 1x128 blocks)."""
    groups = ends.shape[0]
    sa, sb = operands.token_scales(a, a_group, groups), operands.token_scales(b, b_group, groups)
    return native.extension_for(a.data.device).grouped_fp8_tokens_by_tokens(
        operands.codes(a), operands.codes(b), m, ends, sa.tensor, list(sa[1:]), sb.tensor, list(sb[1:]), _mode(a, b, promote_every), out_dtype
    )
