"""The emulated grouped GEMM's product on the GPU where its output needs more than a bf16 GEMM:
one Triton launch that multiplies the factored values and applies their factors before the one
rounding to the output dtype.

torch._grouped_mm writes bf16 alone without reading the group offsets on the host; the
emulated product of a format whose values leave out a per-group or per-row factor (per-tensor
and per-row FP8, NVFP4) needs that factor applied to the fp32 sums, so that the output rounds
once. Here the factors (``a_factor * b_factor``, then the sums times that, as the CPU's torch
ops take them: the same bits) are applied in the kernel's epilogue and the output is written
unpadded in its own dtype, so that no fp32 product, factor matrix or un-padding pass is made.

In the padded layout (graphquant.formats.groups) every group starts at a multiple of 128 rows,
or 16 for a graph's tokens where it runs fprop alone, which the tiles of rows divide: so a tile
lies in one group, and each program reads its group, or its group's bounds, on the device; a
tokens x experts tile of pad rows alone returns at once. bf16 (or fp32, multiplied as fp32)
operands, fp32 accumulation: exact up to fp32 accumulation. (MXFP8 and NVFP4 operands at few
tokens an expert multiply on the decode GEMM's programs instead: triton_decode.experts_gemm.)

torch's grouped kernels may leave an empty group's tokens x tokens product unwritten;
zero_empty_groups writes its zeros in place, touching nothing else (not a pass over the whole
product).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from graphquant.formats.groups import GroupPadding
from graphquant.kernels.triton_grouped_fp8 import GROUP_TILES, tile_of
from graphquant.kernels.triton_launch import ceil_div


class Tile(NamedTuple):
    """A launch's tiling: rows of tiles divide the layout's alignment (tokens x experts: the rows
    its groups start at multiples of; tokens x tokens: BLOCK_K, its reduction's step)."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int


# bf16 operands on the wgmma tensor cores in 128-row tiles where the layout allows; fp32 operands
# (multiplied as fp32, twice the bytes a stage) and 16-row tiles of few tokens in smaller ones.
_BF16_TILE = Tile(128, 128, 64, 8, 4)
# Tokens x experts where the tensor memory accelerator reads both operands (``_tma_operands``):
# wider tiles, which its copies keep fed (grouped_gemm.py's section of benchmarks/NOTES.md).
_TMA_TILE = Tile(128, 256, 64, 8, 4)
_FEW_ROWS_TILE = Tile(16, 64, 64, 4, 4)
_FP32_TILE = Tile(64, 64, 32, 4, 3)


def _tile(dtype: torch.dtype, rows: int) -> Tile:
    """The tiling of a launch on ``dtype`` operands whose row tiles must divide ``rows``."""
    tile = _FP32_TILE if dtype == torch.float32 else _BF16_TILE if rows >= _BF16_TILE.block_m else _FEW_ROWS_TILE
    return tile if rows % tile.block_m == 0 else tile._replace(block_m=rows)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b; fp32 operands multiplied as fp32 (not tf32), so that every product is exact."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _factor(ptr, group, i, stride_g, stride_i, mask, PRESENT: tl.constexpr):
    """A factor of output rows or columns ``i`` of ``group``: ptr[group * stride_g + i * stride_i]
    (stride 0 where the factor is one for the group); 1 where masked or not PRESENT (exact)."""
    if PRESENT:
        factor = tl.load(ptr + group * stride_g + i.to(tl.int64) * stride_i, mask=mask, other=1.0)
    else:
        factor = tl.full(i.shape, 1.0, tl.float32)
    return factor


@triton.jit
def pad_rows_alone(first, source_ptr, ends_ptr, groups):
    """Whether the tile of padded rows from ``first`` holds no token: past the last group's end,
    or its first row a pad row (a group's tokens come first, and a tile lies in one group)."""
    return (first >= tl.load(ends_ptr + groups - 1)) | (tl.load(source_ptr + first) < 0)


@triton.jit
def _tokens_by_experts(
    a_ptr, b_ptr, out_ptr, fa_ptr, fb_ptr, row_group_ptr, source_ptr, ends_ptr, groups, rows, n, k: tl.constexpr,
    stride_am, stride_ak, stride_bg, stride_bk, stride_bn, fa_i, fb_g, fb_i,
    IEEE: tl.constexpr, A_FACTOR: tl.constexpr, B_FACTOR: tl.constexpr, GROUP_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[source[r], :] = (A[r, :] @ B_g) * (fa[r] * fb[g, :]) for the padded rows r of one tile
    (g: their group, read once a tile); a tile of pad rows alone writes nothing."""
    pid_m, pid_n = tile_of(tl.program_id(0), rows // BLOCK_M, tl.cdiv(n, BLOCK_N), GROUP_TILES)
    if pad_rows_alone(pid_m * BLOCK_M, source_ptr, ends_ptr, groups):
        return
    rows_at = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_cols = cols < n
    group = tl.load(row_group_ptr + pid_m * BLOCK_M).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rows_at[:, None] * stride_am + ks[None, :] * stride_ak, mask=ks[None, :] < k, other=0.0)
        b_at = group * stride_bg + ks[:, None].to(tl.int64) * stride_bk + cols[None, :] * stride_bn
        b = tl.load(b_ptr + b_at, mask=(ks[:, None] < k) & in_cols[None, :], other=0.0)
        acc = _dot(a, b, acc, IEEE)
    _tokens_epilogue(acc, out_ptr, fa_ptr, fb_ptr, source_ptr, rows_at, cols, group, rows, n, fa_i, fb_g, fb_i, A_FACTOR, B_FACTOR)


@triton.jit
def _tokens_by_experts_tma(
    a_desc, b_desc, out_ptr, fa_ptr, fb_ptr, row_group_ptr, source_ptr, ends_ptr, groups, rows, n, n_stack, k: tl.constexpr,
    fa_i, fb_g, fb_i, A_FACTOR: tl.constexpr, B_FACTOR: tl.constexpr, GROUP_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``_tokens_by_experts`` with both operands' tiles copied by TMA (zeros past k, and past the
    stack's last row; columns past n, the next expert's rows, are read and not written): the same
    products, summed in the same order, so the same bits. b_desc reads the experts' stack as
    (groups * n_stack, k) rows."""
    pid_m, pid_n = tile_of(tl.program_id(0), rows // BLOCK_M, tl.cdiv(n, BLOCK_N), GROUP_TILES)
    if pad_rows_alone(pid_m * BLOCK_M, source_ptr, ends_ptr, groups):
        return
    rows_at = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    group = tl.load(row_group_ptr + pid_m * BLOCK_M).to(tl.int32)  # TMA coordinates are 32-bit
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        a = a_desc.load([pid_m * BLOCK_M, start])
        b = b_desc.load([group * n_stack + pid_n * BLOCK_N, start])
        acc = tl.dot(a, b.T, acc)
    _tokens_epilogue(acc, out_ptr, fa_ptr, fb_ptr, source_ptr, rows_at, cols, group.to(tl.int64), rows, n, fa_i, fb_g, fb_i, A_FACTOR, B_FACTOR)


@triton.jit
def _tokens_epilogue(acc, out_ptr, fa_ptr, fb_ptr, source_ptr, rows_at, cols, group, rows, n, fa_i, fb_g, fb_i, A_FACTOR: tl.constexpr, B_FACTOR: tl.constexpr):
    """A tokens x experts tile's sums times fa[r] * fb[g, :], written to its tokens' rows of out."""
    in_cols = cols < n
    fa = _factor(fa_ptr, 0, rows_at, 0, fa_i, rows_at < rows, A_FACTOR)
    fb = _factor(fb_ptr, group, cols, fb_g, fb_i, in_cols, B_FACTOR)
    acc = acc * (fa[:, None] * fb[None, :])
    source = tl.load(source_ptr + rows_at)
    out_at = source[:, None] * n + cols[None, :]
    tl.store(out_ptr + out_at, acc.to(out_ptr.dtype.element_ty), mask=(source[:, None] >= 0) & in_cols[None, :])


@triton.jit
def _tokens_by_tokens(
    a_ptr, b_ptr, out_ptr, fa_ptr, fb_ptr, ends_ptr, m, n,
    stride_ar, stride_am, stride_br, stride_bn, fa_g, fa_i, fb_g, fb_i,
    IEEE: tl.constexpr, A_FACTOR: tl.constexpr, B_FACTOR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[g] = (A_g^T B_g) * (fa[g, :, None] * fb[g, None, :]) over group g's rows (bounds read
    on the device); an empty group's sums are 0."""
    group, pid_m, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    end = tl.load(ends_ptr + group).to(tl.int64)
    start = tl.load(ends_ptr + group - 1, mask=group > 0, other=0).to(tl.int64)
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in range(start, end, BLOCK_K):  # group bounds are multiples of BLOCK_K
        rs = r + tl.arange(0, BLOCK_K).to(tl.int64)
        a = tl.load(a_ptr + rs[None, :] * stride_ar + ms[:, None] * stride_am, mask=ms[:, None] < m, other=0.0)
        b = tl.load(b_ptr + rs[:, None] * stride_br + ns[None, :] * stride_bn, mask=ns[None, :] < n, other=0.0)
        acc = _dot(a, b, acc, IEEE)
    fa = _factor(fa_ptr, group, ms, fa_g, fa_i, ms < m, A_FACTOR)
    fb = _factor(fb_ptr, group, ns, fb_g, fb_i, ns < n, B_FACTOR)
    acc = acc * (fa[:, None] * fb[None, :])
    out_at = group.to(tl.int64) * m * n + ms[:, None] * n + ns[None, :]
    tl.store(out_ptr + out_at, acc.to(out_ptr.dtype.element_ty), mask=(ms[:, None] < m) & (ns[None, :] < n))


@triton.jit
def _zero_empty_groups(out_ptr, ends_ptr, size, BLOCK: tl.constexpr):
    """Zeros over group ``program_id(0)``'s ``size`` outputs if it has no rows; the programs of
    a non-empty group return at once."""
    group = tl.program_id(0)
    end = tl.load(ends_ptr + group)
    start = tl.load(ends_ptr + group - 1, mask=group > 0, other=0)
    if end == start:
        base = group.to(tl.int64) * size
        zeros = tl.zeros((BLOCK,), dtype=out_ptr.dtype.element_ty)
        for first in range(tl.program_id(1) * BLOCK, size, tl.num_programs(1) * BLOCK):
            at = first + tl.arange(0, BLOCK)
            tl.store(out_ptr + base + at, zeros, mask=at < size)


# Programs a group for zero_empty_groups: an empty group's zeros spread over this many SMs' worth.
_ZERO_PROGRAMS, _ZERO_BLOCK = 64, 2048


def zero_empty_groups(out: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``out`` (groups, m, n), contiguous, with group g's product zeroed where its rows (``ends``:
    cumulative, on the device) are none."""
    groups = ends.shape[0]
    size = out[0].numel() if groups else 0
    if size:
        _zero_empty_groups[(groups, min(_ZERO_PROGRAMS, ceil_div(size, _ZERO_BLOCK)))](out, ends, size, BLOCK=_ZERO_BLOCK)
    return out


def _factor_strides(factor: Optional[torch.Tensor], absent: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(fp32 tensor, group stride, index stride) of a (groups, count or 1) factor, a dim of one
    read with stride 0; where there is none, ``absent``: a pointer the kernel does not read."""
    if factor is None:
        return absent, 0, 0
    factor = factor.float()
    return factor, factor.stride(0), factor.stride(1) if factor.shape[1] > 1 else 0


def tokens_by_experts(
    a: torch.Tensor,
    experts: torch.Tensor,
    tokens: GroupPadding,
    token_rows: int,
    n: int,
    a_factor: Optional[torch.Tensor],
    b_factor: Optional[torch.Tensor],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """(tokens, n) in ``out_dtype``, unpadded: each token's row of ``a`` (padded_rows, k), in the
    padded layout ``tokens`` (its groups starting at multiples of ``token_rows``), times
    experts[g] (groups, k, n' >= n) of its group g, times a_factor[r] (padded_rows, 1) and
    b_factor[g] (groups, n' or 1), each absent where None."""
    padded_rows, k = a.shape
    out = torch.empty((tokens.position.shape[0], n), dtype=out_dtype, device=a.device)
    fa, _, fa_i = _factor_strides(None if a_factor is None else a_factor.reshape(1, -1), a)
    fb, fb_g, fb_i = _factor_strides(b_factor, a)
    tile = _tile(a.dtype, token_rows)
    tma = _tma_operands(a, experts, tile)
    tile = _TMA_TILE if tma else tile
    grid = ((padded_rows // tile.block_m) * ceil_div(n, tile.block_n),)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        stack = experts.transpose(1, 2)
        _tokens_by_experts_tma[grid](
            TensorDescriptor.from_tensor(a, [tile.block_m, tile.block_k]),
            TensorDescriptor.from_tensor(stack.reshape(-1, k), [tile.block_n, tile.block_k]),
            out, fa, fb, tokens.row_group, tokens.source, tokens.ends, tokens.groups, padded_rows, n, stack.shape[1], k,
            fa_i, fb_g, fb_i, A_FACTOR=a_factor is not None, B_FACTOR=b_factor is not None, GROUP_TILES=GROUP_TILES,
            BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, num_warps=tile.warps, num_stages=tile.stages,
        )
        return out
    _tokens_by_experts[grid](
        a, experts, out, fa, fb, tokens.row_group, tokens.source, tokens.ends, tokens.groups, padded_rows, n, k,
        *a.stride(), *experts.stride(), fa_i, fb_g, fb_i, IEEE=a.dtype == torch.float32,
        A_FACTOR=a_factor is not None, B_FACTOR=b_factor is not None, GROUP_TILES=GROUP_TILES,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, num_warps=tile.warps, num_stages=tile.stages,
    )
    return out


def _tma_operands(a: torch.Tensor, experts: torch.Tensor, tile: Tile) -> bool:
    """Whether TMA can copy both operands' tiles: bf16 in 128-row tiles, a's rows and the experts'
    (groups, n', k) stack each contiguous, 16-byte aligned, k a multiple of 8 (16 bytes)."""
    stack = experts.transpose(1, 2)
    return (
        a.dtype == experts.dtype == torch.bfloat16 and tile.block_m == _TMA_TILE.block_m and a.shape[1] % 8 == 0
        and a.is_contiguous() and stack.is_contiguous() and a.data_ptr() % 16 == 0 and stack.data_ptr() % 16 == 0
    )


def tokens_by_tokens(
    a: torch.Tensor,
    b: torch.Tensor,
    ends: torch.Tensor,
    m: int,
    a_factor: Optional[torch.Tensor],
    b_factor: Optional[torch.Tensor],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """(groups, m, n) in ``out_dtype``: a (rows, m' >= m) and b (rows, n) reduced over each group's
    rows (``ends``, multiples of 128), times a_factor[g] (groups, m' or 1) and b_factor[g]
    (groups, n or 1) along the product's rows and columns, each absent where None."""
    n = b.shape[1]
    groups = ends.shape[0]
    out = torch.empty((groups, m, n), dtype=out_dtype, device=a.device)
    fa, fa_g, fa_i = _factor_strides(a_factor, a)
    fb, fb_g, fb_i = _factor_strides(b_factor, a)
    tile = _tile(a.dtype, 128)
    grid = (groups, ceil_div(m, tile.block_m), ceil_div(n, tile.block_n))
    _tokens_by_tokens[grid](
        a, b, out, fa, fb, ends, m, n, *a.stride(), *b.stride(), fa_g, fa_i, fb_g, fb_i, IEEE=a.dtype == torch.float32,
        A_FACTOR=a_factor is not None, B_FACTOR=b_factor is not None, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, num_warps=tile.warps, num_stages=tile.stages,
    )
    return out
