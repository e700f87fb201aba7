"""The emulated grouped GEMM's product with an fp32 output, on the GPU, one Triton launch.

torch._grouped_mm writes bf16 alone without reading the group offsets on the host; the
emulated product of a format whose values leave out a per-group or per-row factor (per-tensor
and per-row FP8, NVFP4) needs fp32, so that the factor applied afterwards rounds once. In the
padded layout (graphquant.formats.groups) every group starts at a multiple of 128 rows, or 16
for a graph's tokens where it runs fprop alone, which the tiles of rows divide: so a tile lies in
one group, and each program reads its group, or its group's bounds, on the device; a tokens x
experts tile of pad rows alone returns at once. bf16 (or fp32, multiplied as fp32) operands,
fp32 accumulation, fp32 output: exact up to fp32 accumulation. (MXFP8 and NVFP4 operands at few
tokens an expert multiply on the decode GEMM's programs instead: triton_decode.experts_gemm.)

torch's grouped kernels may leave an empty group's tokens x tokens product unwritten;
zero_empty_groups writes its zeros in place, touching nothing else (a torch.where over the whole
product cost a full pass: 2.8 ms of an MXFP8 MoE step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphquant.formats.groups import GroupPadding
from graphquant.kernels.triton_launch import ceil_div

# Tiles along the grouped rows divide the layout's 128-row alignment (tokens x experts: at most the
# rows its groups start at multiples of).
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b; fp32 operands multiplied as fp32 (not tf32), so that every product is exact."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def pad_rows_alone(first, source_ptr, ends_ptr, groups):
    """Whether the tile of padded rows from ``first`` holds no token: past the last group's end,
    or its first row a pad row (a group's tokens come first, and a tile lies in one group)."""
    return (first >= tl.load(ends_ptr + groups - 1)) | (tl.load(source_ptr + first) < 0)


@triton.jit
def _tokens_by_experts(
    a_ptr, b_ptr, out_ptr, row_group_ptr, source_ptr, ends_ptr, groups, n, k: tl.constexpr,
    stride_am, stride_ak, stride_bg, stride_bk, stride_bn,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[r, :] = A[r, :] @ B[g] for the rows r of one tile, g their group (read once a tile); a
    tile of pad rows alone writes nothing."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pad_rows_alone(pid_m * BLOCK_M, source_ptr, ends_ptr, groups):
        return
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    group = tl.load(row_group_ptr + pid_m * BLOCK_M).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak, mask=ks[None, :] < k, other=0.0)
        b_at = group * stride_bg + ks[:, None].to(tl.int64) * stride_bk + cols[None, :] * stride_bn
        b = tl.load(b_ptr + b_at, mask=(ks[:, None] < k) & (cols[None, :] < n), other=0.0)
        acc = _dot(a, b, acc, IEEE)
    tl.store(out_ptr + rows[:, None] * n + cols[None, :], acc, mask=cols[None, :] < n)


@triton.jit
def _tokens_by_tokens(
    a_ptr, b_ptr, out_ptr, ends_ptr, m, n,
    stride_ar, stride_am, stride_br, stride_bn,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[g] = A_g^T B_g over group g's rows (bounds read on the device); an empty group's is 0."""
    group, pid_m, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    end = tl.load(ends_ptr + group).to(tl.int64)
    start = tl.load(ends_ptr + group - 1, mask=group > 0, other=0).to(tl.int64)
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    r = start
    while r < end:  # group bounds are multiples of BLOCK_K
        rs = r + tl.arange(0, BLOCK_K).to(tl.int64)
        a = tl.load(a_ptr + rs[None, :] * stride_ar + ms[:, None] * stride_am, mask=ms[:, None] < m, other=0.0)
        b = tl.load(b_ptr + rs[:, None] * stride_br + ns[None, :] * stride_bn, mask=ns[None, :] < n, other=0.0)
        acc = _dot(a, b, acc, IEEE)
        r += BLOCK_K
    out_at = group.to(tl.int64) * m * n + ms[:, None] * n + ns[None, :]
    tl.store(out_ptr + out_at, acc, mask=(ms[:, None] < m) & (ns[None, :] < n))


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


def tokens_by_experts(a: torch.Tensor, experts: torch.Tensor, tokens: GroupPadding, token_rows: int) -> torch.Tensor:
    """fp32 (rows, n): a (rows, k), in the padded layout ``tokens`` (its groups starting at
    multiples of ``token_rows``), times experts[g] (groups, k, n) for the rows of group g; the pad
    rows' are left unwritten where a whole tile is pad rows."""
    rows, k = a.shape
    n = experts.shape[2]
    out = torch.empty((rows, n), dtype=torch.float32, device=a.device)
    block_m = min(BLOCK_M, token_rows)
    grid = (rows // block_m, ceil_div(n, BLOCK_N))
    _tokens_by_experts[grid](
        a, experts, out, tokens.row_group, tokens.source, tokens.ends, tokens.groups, n, k, *a.stride(), *experts.stride(),
        IEEE=a.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )
    return out


def tokens_by_tokens(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """fp32 (groups, m, n): a (rows, m) and b (rows, n) reduced over each group's rows (ends)."""
    m, n = a.shape[1], b.shape[1]
    groups = ends.shape[0]
    out = torch.empty((groups, m, n), dtype=torch.float32, device=a.device)
    grid = (groups, ceil_div(m, BLOCK_M), ceil_div(n, BLOCK_N))
    _tokens_by_tokens[grid](
        a, b, out, ends, m, n, *a.stride(), *b.stride(), IEEE=a.dtype == torch.float32, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K
    )
    return out
