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
``tokens_by_coded_experts`` reads their codes and block scales, decodes a tile in registers into
the emulation's values (exact in bf16), multiplies on the tensor cores with fp32 accumulation and
applies the factors the values leave out (NVFP4's global decode) once, writing each token's row
of the output. Programs whose rows are all padding return at once, so a decode step reads only
the experts its tokens were routed to, once.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from graphquant.formats import fp8
from graphquant.formats.groups import GroupPadding
from graphquant.kernels.triton_dequantize import e2m1_value_over_2_14, e8m0_value
from graphquant.kernels.triton_launch import ceil_div
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


# The operands tokens_by_coded_experts decodes: the layout families of emulation's block values.
CODED = {"mxfp8": 1, "nvfp4": 2, "nvfp4_row_scaled": 2}
# Its tiles: 16 rows, so that a decode step's 1-row group multiplies 16 rows, not 64; K tiles of
# whole scale blocks. It runs where the tokens are at most CODED_BLOCK_M an expert on average:
# from 8 to 1024 routed rows among 64 experts it ties (NVFP4 at 8) or beats (up to 2.8x) writing
# the routed experts' values first, and at 16384 it is slower (benchmarks/grouped_decode.py).
CODED_BLOCK_M, CODED_BLOCK_N, CODED_BLOCK_K = 16, 64, 128


@triton.jit
def _coded_tile(ptr, scale_ptr, rows, start, k, stride_r, stride_k, scale_r, scale_k, FORMAT: tl.constexpr, BF16: tl.constexpr,
                ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """(ROWS, BLOCK_K) values of a k-last MXFP8 (FORMAT 1) or NVFP4 (2) operand's ``rows`` at
    reductions start.. (zeros past k): codes times block scales, exact in bf16 (BF16) and fp32."""
    if FORMAT == 1:  # a scale per 32 codes, loaded once and broadcast
        ks = start + tl.arange(0, BLOCK_K)
        in_k = ks[None, :] < k
        codes = tl.load(ptr + rows[:, None] * stride_r + ks[None, :] * stride_k, mask=in_k, other=0.0)
        blocks = start // 32 + tl.arange(0, BLOCK_K // 32)
        biased = tl.load(scale_ptr + rows[:, None] * scale_r + blocks[None, :] * scale_k, mask=blocks[None, :] < k // 32, other=127)
        scale = tl.reshape(tl.broadcast_to(e8m0_value(biased)[:, :, None], (ROWS, BLOCK_K // 32, 32)), (ROWS, BLOCK_K))
        values = codes.to(tl.float32) * scale  # codes typed E4M3 or E5M2
    else:  # two codes a byte, the even column in the low nibble; a scale per 16 codes (8 bytes)
        byte = start // 2 + tl.arange(0, BLOCK_K // 2)
        in_k = byte[None, :] < k // 2
        packed = tl.load(ptr + rows[:, None] * stride_r + byte[None, :] * stride_k, mask=in_k, other=0).to(tl.int32)
        blocks = start // 16 + tl.arange(0, BLOCK_K // 16)
        scale = tl.load(scale_ptr + rows[:, None] * scale_r + blocks[None, :] * scale_k, mask=blocks[None, :] < k // 16, other=0.0)
        scale = scale.to(tl.float32) * 16384.0  # undoes the decoded codes' 2^-14, exactly
        scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (ROWS, BLOCK_K // 16, 8)), (ROWS, BLOCK_K // 2))
        low = e2m1_value_over_2_14(packed & 0xF).to(tl.float32) * scale
        values = tl.interleave(low, e2m1_value_over_2_14(packed >> 4).to(tl.float32) * scale)
    if BF16:
        values = values.to(tl.bfloat16)
    return values


@triton.jit
def _tokens_by_coded_experts(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, fa_ptr, fb_ptr, out_ptr, row_group_ptr, source_ptr, ends_ptr,
    groups, per_group, n, k,
    stride_am, stride_ak, sa_m, sa_k, stride_bn, stride_bk, sb_n, sb_k, stride_om,
    FORMAT: tl.constexpr, HAS_FA: tl.constexpr, HAS_FB: tl.constexpr,
    BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[source[r], c] = (A[r] . B_g[c]) * fa[r] * fb[g, c] for the padded rows r of one tile
    (g their group); a tile of pad rows alone returns at once."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    first = pid_m * BLOCK_M
    if _pad_rows_alone(first, source_ptr, ends_ptr, groups):
        return
    rows = (first + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_cols = cols < n
    group = tl.load(row_group_ptr + first).to(tl.int64)
    b_rows = group * per_group + tl.where(in_cols, cols, 0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        a = _coded_tile(a_ptr, a_scale_ptr, rows, start, k, stride_am, stride_ak, sa_m, sa_k, FORMAT, BF16, BLOCK_M, BLOCK_K)
        b = _coded_tile(b_ptr, b_scale_ptr, b_rows, start, k, stride_bn, stride_bk, sb_n, sb_k, FORMAT, BF16, BLOCK_N, BLOCK_K)
        acc = _dot(a, tl.trans(b), acc, not BF16)
    if HAS_FA or HAS_FB:  # one factor, fa * fb, as the emulation's alpha
        if HAS_FA and HAS_FB:
            alpha = tl.load(fa_ptr + rows)[:, None] * tl.load(fb_ptr + b_rows)[None, :]
        elif HAS_FA:
            alpha = tl.load(fa_ptr + rows)[:, None]
        else:
            alpha = tl.load(fb_ptr + b_rows)[None, :]
        acc = acc * alpha
    source = tl.load(source_ptr + rows)
    tl.store(out_ptr + source[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(source[:, None] >= 0) & in_cols[None, :])


def _coded_format(rep: Representation) -> Optional[int]:
    gemm_input = rep.quantizer.gemm_input(rep.direction)
    return None if gemm_input is None or not rep.stored_k_last else CODED.get(gemm_input.family)


def decodes(a: Representation, b: Representation, tokens: int, groups: int) -> bool:
    """Whether tokens_by_coded_experts multiplies A (``tokens`` rows, rowwise) by the stack B of
    ``groups`` experts: both MXFP8 or both NVFP4, each with its reduction dim stored last, B's
    rows its experts' GEMM rows, and few enough tokens (CODED_BLOCK_M)."""
    fa = _coded_format(a)
    return (
        tokens <= CODED_BLOCK_M * groups and fa is not None and fa == _coded_format(b)
        and a.direction == ROWWISE and b.direction == ROWWISE
    )


def _flat_factor(rep: Representation, row_group: torch.Tensor) -> Optional[torch.Tensor]:
    """The factor of each GEMM row (Quantizer.grouped_factor; (rows, 1) for a rowwise operand), flat fp32."""
    factor = rep.quantizer.grouped_factor(rep, row_group)
    return None if factor is None else factor.float().reshape(-1).contiguous()


def tokens_by_coded_experts(
    a: Representation, b: Representation, b_group: torch.Tensor, tokens: GroupPadding, n: int, out_dtype: torch.dtype
) -> torch.Tensor:
    """(tokens, n): row t is A's padded row tokens.position[t] times its group's B (the first n
    of its GEMM rows: the padding dropped), for operands that ``decodes`` takes (any number of
    tokens)."""
    groups, rows, k = tokens.groups, a.data.shape[0], a.shape[1]
    out = torch.empty((tokens.position.shape[0], n), dtype=out_dtype, device=a.data.device)
    fa, fb = _flat_factor(a, tokens.row_group), _flat_factor(b, b_group)
    interpreted = triton.knobs.runtime.interpret  # whose dot multiplies bf16 wrongly: fp32 values there
    grid = (ceil_div(rows, CODED_BLOCK_M), ceil_div(n, CODED_BLOCK_N))
    _tokens_by_coded_experts[grid](
        _codes(a), a.scale, _codes(b), b.scale, a.scale if fa is None else fa, b.scale if fb is None else fb, out,
        tokens.row_group, tokens.source, tokens.ends, groups, b.data.shape[0] // groups, n, k,
        *a.data.stride(), *a.scale.stride(), *b.data.stride(), *b.scale.stride(), out.stride(0),
        FORMAT=_coded_format(a), HAS_FA=fa is not None, HAS_FB=fb is not None,
        BF16=not interpreted, BLOCK_M=CODED_BLOCK_M, BLOCK_N=CODED_BLOCK_N, BLOCK_K=CODED_BLOCK_K,
    )
    return out


def _codes(rep: Representation) -> torch.Tensor:
    """MXFP8 codes typed as their element (so that a load reads their values), NVFP4's bytes as they are."""
    element = rep.quantizer.gemm_input(rep.direction).element
    return rep.data.view(fp8.FP8_DTYPES.get(element, rep.data.dtype))
