"""The emulated grouped GEMM's product with an fp32 output, on the GPU, one Triton launch; and
its tokens x experts product of MXFP8 or NVFP4 operands decoded in registers.

torch._grouped_mm writes bf16 alone without reading the group offsets on the host; the
emulated product of a format whose values leave out a per-group or per-row factor (per-tensor
and per-row FP8, NVFP4) needs fp32, so that the factor applied afterwards rounds once. In the
padded layout (graphquant.formats.groups) every group starts at a multiple of 128 rows, so a
tile of rows lies in one group, and each program reads its group, or its group's bounds, on the
device; a tokens x experts tile of pad rows alone returns at once. bf16 (or fp32, multiplied as
fp32) operands, fp32 accumulation, fp32 output: exact up to fp32 accumulation.

MXFP8 and NVFP4 operands whose reduction dim is stored last need no values in memory at all:
``tokens_by_coded_experts`` runs the decode GEMM's programs (graphquant.kernels.triton_decode:
codes and block scales read as 64-bit words, decoded in registers into the emulation's values,
exact in bf16 and fp16, multiplied on the tensor cores with fp32 accumulation) on each tile of
tokens against its expert's rows of the stack, and applies the factors the values leave out
(NVFP4's global decode) once, writing each token's row of the output. Programs whose rows are
all padding return at once, so a decode step reads only the experts its tokens were routed to,
once.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from graphquant.formats.groups import GroupPadding
from graphquant.kernels import triton_decode
from graphquant.kernels.triton_launch import ceil_div, launch
from graphquant.quantizers import ROWWISE, Representation

# Tiles along the grouped rows divide the layout's 128-row alignment.
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b; fp32 operands multiplied as fp32 (not tf32), so that every product is exact."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _pad_rows_alone(first, source_ptr, ends_ptr, groups):
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
    if _pad_rows_alone(pid_m * BLOCK_M, source_ptr, ends_ptr, groups):
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


def tokens_by_experts(a: torch.Tensor, experts: torch.Tensor, tokens: GroupPadding) -> torch.Tensor:
    """fp32 (rows, n): a (rows, k), in the padded layout ``tokens``, times experts[g] (groups, k,
    n) for the rows of group g; the pad rows' are left unwritten where a whole tile is pad rows."""
    rows, k = a.shape
    n = experts.shape[2]
    out = torch.empty((rows, n), dtype=torch.float32, device=a.device)
    grid = (rows // BLOCK_M, ceil_div(n, BLOCK_N))
    _tokens_by_experts[grid](
        a, experts, out, tokens.row_group, tokens.source, tokens.ends, tokens.groups, n, k, *a.stride(), *experts.stride(),
        IEEE=a.dtype == torch.float32, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
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


# Its programs: the decode GEMM's default tiling (64 rows of an expert's weights, 16 of tokens, K
# in steps of 256), so that a decode step's one-token groups multiply 16 rows, not 64. It runs
# where the tokens are at most CODED_TILING.block_m an expert on average: from 8 to 1024 routed
# rows among 64 experts the kernel it replaced tied (NVFP4 at 8) or beat (up to 2.8x) writing the
# routed experts' values first, and at 16384 it was slower (benchmarks/grouped_decode.py).
CODED_TILING = triton_decode.VALUE_TILES[0][1]
# Routed rows at most a quarter of the experts (a decode step's tokens, each routed to experts few
# other tokens share) run one token a program instead, on the decode GEMM's one-row FMA program
# (triton_decode.tokens_by_expert_rows): each reads its expert's rows once, with no tile of 16
# rows decoded for one. The quarter is a guess no GPU has timed yet (grouped_decode.py).
ONE_TOKEN_EXPERTS_A_ROW = 4


@triton.jit
def _tokens_by_coded_experts(
    a_ptr, a_scale_ptr, a_stride, sa_m, sa_k, b_ptr, b_scale_ptr, b_stride, sb_n, sb_k, a_amax_ptr, b_amax_ptr, out_ptr,
    row_group_ptr, source_ptr, ends_ptr, groups, per_group, n, rows, stack_rows, k, k_chunks, stride_om,
    OPERAND: tl.constexpr, SCALE_COLS: tl.constexpr, A_FACTOR: tl.constexpr, A_DIVISOR: tl.constexpr, B_FACTOR: tl.constexpr,
    B_DIVISOR: tl.constexpr, ASM: tl.constexpr, WHOLE_TILES: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[source[r], c] = (A[r] . B_g[c]) * fa[r] * fb[g, c] for the padded rows r of one tile
    (g their group); a tile of pad rows alone returns at once. The products are the decode GEMM's
    (triton_decode.tile_sums over all of K): the weights its left operand, decoded from 64-bit
    words in registers (by inline PTX where ASM), the tokens' few rows the tensor cores' other.
    The factors (Quantizer.grouped_factor) are made from the operands' amaxes here, as the decode
    GEMM makes them (A_FACTOR, B_FACTOR: _grouped_factor's kinds)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    first = pid_m * BLOCK_M
    if _pad_rows_alone(first, source_ptr, ends_ptr, groups):
        return
    rows_here = (first + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_cols = cols < n
    group = tl.load(row_group_ptr + first).to(tl.int64)
    b_rows = group * per_group + tl.where(in_cols, cols, 0)
    acc = triton_decode.tile_sums(
        a_ptr, a_scale_ptr, a_stride, sa_m, sa_k, b_ptr, b_scale_ptr, b_stride, sb_n, sb_k, b_rows[:, None], rows_here[:, None],
        stack_rows, rows, k, 0, k_chunks, None, CHUNK, OPERAND, SCALE_COLS, 1, 1, 0, 0, "", "", ASM, WHOLE_TILES,
        BLOCK_M, BLOCK_N, BLOCK_K, None, False, False,
    )
    if A_FACTOR != 0 and B_FACTOR != 0:  # one factor, fa * fb, as the emulation's alpha
        fa = _grouped_factor(a_amax_ptr, group, rows_here[None, :], A_FACTOR, A_DIVISOR)
        acc = acc * (fa * _grouped_factor(b_amax_ptr, group, b_rows[:, None], B_FACTOR, B_DIVISOR))
    elif A_FACTOR != 0:
        acc = acc * _grouped_factor(a_amax_ptr, group, rows_here[None, :], A_FACTOR, A_DIVISOR)
    elif B_FACTOR != 0:
        acc = acc * _grouped_factor(b_amax_ptr, group, b_rows[:, None], B_FACTOR, B_DIVISOR)
    source = tl.load(source_ptr + rows_here)
    tl.store(out_ptr + source[None, :] * stride_om + cols[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=(source[None, :] >= 0) & in_cols[:, None])


@triton.jit
def _grouped_factor(amax_ptr, group, rows, KIND: tl.constexpr, DIVISOR: tl.constexpr):
    """A grouped operand's factor from its amaxes (NVFP4's global decode), as the decode GEMM
    makes an operand's factor (triton_decode.operand_factor): one a group (KIND 1,
    TENSOR_FACTOR: the tile's group's), or one a row (``rows``, of the stack or of the tokens)."""
    if KIND == 1:
        factor = triton_decode.operand_factor(amax_ptr + group, 0, True, 1, DIVISOR)
    else:
        factor = triton_decode.operand_factor(amax_ptr, rows, True, 2, DIVISOR)
    return factor


def _coded_layout(rep: Representation) -> Optional[triton_decode._Layout]:
    """The decode GEMM's layout of a k-last MXFP8 (E4M3) or NVFP4 operand, or None."""
    gemm_input = rep.quantizer.gemm_input(rep.direction)
    layout = None if gemm_input is None else triton_decode.LAYOUTS.get(gemm_input.family)
    coded = layout is not None and layout.operand != triton_decode.FP8_CODES and rep.stored_k_last and triton_decode.reads(gemm_input)
    return layout if coded else None


def decodes(a: Representation, b: Representation, tokens: int, groups: int) -> bool:
    """Whether tokens_by_coded_experts multiplies A (``tokens`` rows, rowwise) by the stack B of
    ``groups`` experts: both MXFP8 (E4M3) or both NVFP4, each with its reduction dim stored last,
    B's rows its experts' GEMM rows, and few enough tokens (CODED_TILING.block_m an expert)."""
    la, lb = _coded_layout(a), _coded_layout(b)
    return (
        tokens <= CODED_TILING.block_m * groups and la is not None and lb is not None and la.operand == lb.operand
        and a.direction == ROWWISE and b.direction == ROWWISE
    )


def _as_words(rep: Representation) -> tuple:
    """(codes, scales, the codes' row stride in 64-bit words, the scales' strides), as
    triton_decode.tile_sums reads an operand."""
    data, scale, _, stride_words, *scale_strides = triton_decode.as_words((rep.data, rep.scale, None, rep.data.stride(0), *rep.scale.stride()))
    return data, scale, stride_words, *scale_strides


def one_token_a_program(tokens: int, groups: int) -> bool:
    """Whether tokens_by_coded_experts runs one token a program (ONE_TOKEN_EXPERTS_A_ROW)."""
    return tokens * ONE_TOKEN_EXPERTS_A_ROW <= groups


def tokens_by_coded_experts(
    a: Representation, b: Representation, b_group: torch.Tensor, tokens: GroupPadding, n: int, out_dtype: torch.dtype
) -> torch.Tensor:
    """(tokens, n): row t is A's padded row tokens.position[t] times its group's B (the first n
    of its GEMM rows: the padding dropped), for operands that ``decodes`` takes (any number of
    tokens)."""
    groups, rows, k = tokens.groups, a.data.shape[0], a.shape[1]
    if one_token_a_program(tokens.position.shape[0], groups):
        return triton_decode.tokens_by_expert_rows(a, b, tokens.position, tokens.row_group, groups, n, out_dtype)
    out = torch.empty((tokens.position.shape[0], n), dtype=out_dtype, device=a.data.device)
    la, lb, tiling = _coded_layout(a), _coded_layout(b), CODED_TILING
    grid = (ceil_div(rows, tiling.block_m), ceil_div(n, tiling.block_n))
    a_words, b_words = _as_words(a), _as_words(b)
    k_chunks = ceil_div(k, triton_decode.K_CHUNK)
    launch(
        _tokens_by_coded_experts, grid, *a_words, *b_words, a.amax if la.factor else a.scale, b.amax if lb.factor else b.scale, out,
        tokens.row_group, tokens.source, tokens.ends, groups, b.data.shape[0] // groups, n, rows, b.data.shape[0], k,
        k_chunks, out.stride(0),
        OPERAND=lb.operand, SCALE_COLS=lb.scale_block[1], **triton_decode.factor_arguments(la, lb),
        ASM=not triton.knobs.runtime.interpret, WHOLE_TILES=k == k_chunks * triton_decode.K_CHUNK, CHUNK=triton_decode.K_CHUNK,
        BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n, BLOCK_K=tiling.block_k, num_warps=tiling.warps, num_stages=tiling.stages,
    )
    return out
