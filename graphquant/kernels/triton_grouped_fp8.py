"""The native FP8 grouped GEMM: every group's product of two FP8 grouped representations in one
Triton launch, the scales applied inside it, the group offsets read on the device.

It multiplies the FP8 codes on the tensor cores and applies the formats' scales in fp32:
per-tensor and per-row scales (one factor per GEMM row of each operand, ``Quantizer.grouped_factor``)
once in the epilogue; block scales to each K block's partial product: DeepSeek-V3's 1x128 and
128x128 blocks (fp32 scales) to each 128-long block's, as its recipe does, and MXFP8's E8M0
scales (2^(e - 127): 2^-127 for code 0, NaN for 255) to each 32-long block's (one wgmma's).
Partial sums are promoted from the tensor cores' accumulator into fp32 after every 32 products
(``max_num_imprecise_acc``), as cuBLASLt's promoted FP8 GEMMs do, so it keeps a recipe's
fp32-accumulation contract: 2^-9 of relative error per term at most. E4M3 and E5M2 on either side.

A block's sum is multiplied by A's scale, then by B's, in fp32: one rounding (the first product
is exact) wherever the sum times A's scale lies in fp32's range, so that scales whose product is
outside it (MXFP8's 2^(ea - 127) 2^(eb - 127)) still give the block's value. That holds at the
small end for E4M3 A (its sums are multiples of 2^-18, A's scale at least 2^-127), and at the
large end while A's scale is under 2^105 (MXFP8 codes under 233: blocks of values under 2^113,
about 1e34), past which a block's value may be inf where it is not. The result is rounded once,
to the output dtype, and written straight to the unpadded output: no padded fp32 product, no
factor tensor, no copy afterwards.

The two products of graphquant.kernels.grouped, on graphquant.formats.groups' padded layout
(every group starts at a multiple of 128 rows, so a tile of 128 rows lies in one group):

    tokens x experts (fprop, dgrad)  out[source[r]] = A[r] @ B_g for the padded rows r of group g
    tokens x tokens (wgrad)          out[g] = A_g^T B_g over group g's padded rows (an empty group: 0)

Both operands are read with the reduction dim contiguous (``k_last``): rowwise data and the FP8
formats' columnwise data (stored transposed) as they are, MXFP8's columnwise data (stored as the
tensor is) copied transposed first (graphquant::transposed), since the FP8 tensor cores read both
operands K-major and a tile loaded K-first would be transposed in registers, its loads not
pipelined. The dense MXFP8 GEMM (graphquant.kernels.triton_mxfp8) shares this file's jit helpers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from graphquant.formats.groups import GROUP_ROWS
from graphquant.kernels import scaled_mm
from graphquant.kernels.triton_dequantize import e8m0_value
from graphquant.quantizers import ROWWISE, Representation

BACKEND = "triton fp8 grouped"
_ROW_SCALED = ("fp8_tensorwise", "fp8_rowwise")
# The K extent of each block-scaled family's scales (the rows of a 128x128 tile's too); the
# row-scaled families' factors are applied after the sum (scale block 0).
SCALE_BLOCKS = {"fp8_block_1x128": 128, "fp8_block_128x128": 128, "mxfp8": 32}
# fprop and dgrad multiply activations or gradients (1x128) by weights (128x128, or 1x128), wgrad
# two 1x128 operands; per-tensor and per-row scales in any combination; MXFP8 by MXFP8.
FAMILY_PAIRS = frozenset(
    {(x, y) for x in _ROW_SCALED for y in _ROW_SCALED}
    | {(x, y) for x in ("fp8_block_1x128", "fp8_block_128x128") for y in ("fp8_block_1x128", "fp8_block_128x128")}
    | {("mxfp8", "mxfp8")}
)
_FP8 = ("e4m3", "e5m2")
ELEMENT_PAIRS = frozenset((x, y) for x in _FP8 for y in _FP8)
PROMOTE_EVERY = 32  # products summed in the tensor cores' accumulator before fp32 takes them


def _tile(block_m: int, block_n: int, block_k: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k}, num_warps=warps, num_stages=stages)


# Each kernel's tiles by its scale block (0: factors after the sum; per-block partial sums take
# registers: smaller tiles), the fastest of benchmarks/grouped_gemm_sweep.py's on an H200 at an
# MoE step's shapes; an autotuner picks among a kind's by shape. K tiles of one block scale where
# scales are per block; row tiles of tokens x experts within the layout's 128-row alignment.
_TOKENS_BY_EXPERTS_TILES = {
    0: [_tile(128, 128, 128, 8, 3)],
    128: [_tile(64, 64, 128, 4, 3)],
    32: [_tile(128, 128, 32, 8, 4), _tile(64, 128, 32, 4, 6)],
}
_TOKENS_BY_TOKENS_TILES = {
    0: [_tile(128, 128, 128, 8, 3), _tile(64, 128, 64, 4, 4)],
    128: [_tile(128, 64, 128, 4, 3)],
    32: [_tile(128, 128, 32, 8, 4), _tile(128, 64, 32, 4, 6)],
}


def autotune(tiles: dict[int, list[triton.Config]], key: list[str]):
    """An autotuner over the tiles of the call's kind (its SCALE_BLOCK). The interpreter runs a
    kernel's logic, not its speed: the kind's first tile alone there."""
    if triton.knobs.runtime.interpret:
        first = lambda name: lambda args: tiles[args["SCALE_BLOCK"]][0].kwargs[name]  # noqa: E731
        return triton.heuristics({name: first(name) for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K")})
    return triton.autotune(
        configs=[tile for kind in tiles.values() for tile in kind], key=key,
        prune_configs_by={"early_config_prune": lambda configs, named_args, **kwargs: tiles[kwargs["SCALE_BLOCK"]]},
    )


GROUP_TILES = 8  # tile rows a launch walks before the next tile column, so that B stays in L2


class Scales(NamedTuple):
    """Where an operand's scales lie: the scale of its GEMM row i (in group g) and K block kb is at
    ``tensor + g * group + (i // rows) * row + kb * block``. A per-tensor or per-row factor has
    block 0 (applied once, after the sum); a block scale's rows are 1 or 128."""

    tensor: torch.Tensor
    group: int
    row: int
    block: int
    rows: int = 1


@triton.jit
def fp8_tile(ptrs, mask, E5M2: tl.constexpr):
    """FP8 codes (masked lanes +0; mask None: none masked) read as E4M3 or E5M2."""
    if mask is None:
        codes = tl.load(ptrs)
    else:
        codes = tl.load(ptrs, mask=mask, other=0.0)
    return codes.to(tl.float8e5 if E5M2 else tl.float8e4nv, bitcast=True)


@triton.jit
def scale(ptr, group, i, kb, stride_g, stride_i, stride_k, mask, ROWS: tl.constexpr, E8M0: tl.constexpr = False):
    """The fp32 scales of GEMM rows ``i`` of ``group`` in K block ``kb`` (see Scales), stored as
    fp32 or (E8M0) as biased exponents; masked lanes (mask None: none masked) read 0 or 2^-127."""
    at = group * stride_g + (i // ROWS).to(tl.int64) * stride_i + kb * stride_k
    if mask is None:
        scales = tl.load(ptr + at)
    else:
        scales = tl.load(ptr + at, mask=mask, other=0)
    if E8M0:
        scales = e8m0_value(scales)
    return scales


@triton.jit
def scaled_block(acc, a, b, sa, sb, PROMOTE_EVERY: tl.constexpr):
    """acc plus one K block's product of FP8 tiles times its scales (A's per row, then B's per
    column), the block's sum promoted into fp32 after every PROMOTE_EVERY products."""
    return acc + (tl.dot(a, b, max_num_imprecise_acc=PROMOTE_EVERY) * sa[:, None]) * sb[None, :]


@triton.jit
def tile_of(pid, tiles_m, tiles_n, GROUP_TILES: tl.constexpr):
    """(tile row, tile column) of program ``pid``, GROUP_TILES tile rows per column in turn."""
    width = GROUP_TILES * tiles_n
    first = (pid // width) * GROUP_TILES
    height = tl.minimum(tiles_m - first, GROUP_TILES)
    return first + (pid % width) % height, (pid % width) // height


@autotune(_TOKENS_BY_EXPERTS_TILES, key=["n", "k", "SCALE_BLOCK", "E8M0", "A_E5M2", "B_E5M2", "A_ROWS", "B_ROWS"])
@triton.heuristics({"EVEN_K": lambda args: args["k"] % args["BLOCK_K"] == 0})
@triton.jit
def _tokens_by_experts(
    a_ptr, b_ptr, out_ptr, row_group_ptr, source_ptr, ends_ptr, groups, rows, n, k,
    stride_am, stride_ak, stride_bg, stride_bk, stride_bn, stride_om,
    sa_ptr, sa_g, sa_i, sa_k, sb_ptr, sb_g, sb_i, sb_k,
    SCALE_BLOCK: tl.constexpr, E8M0: tl.constexpr, A_ROWS: tl.constexpr, B_ROWS: tl.constexpr, A_E5M2: tl.constexpr,
    B_E5M2: tl.constexpr, PROMOTE_EVERY: tl.constexpr, GROUP_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):
    """out[source[r], :] = A[r, :] @ B_g for the padded rows r of one tile (g: their group, read
    once a tile); tiles past the last group's end hold no rows and return at once."""
    pid_m, pid_n = tile_of(tl.program_id(0), tl.cdiv(rows, BLOCK_M), tl.cdiv(n, BLOCK_N), GROUP_TILES)
    if pid_m * BLOCK_M >= tl.load(ends_ptr + groups - 1):
        return
    rows_at = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_cols = cols < n
    group = tl.load(row_group_ptr + pid_m * BLOCK_M).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows_at[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + group * stride_bg + offs_k[:, None] * stride_bk + cols[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        if EVEN_K:
            a = fp8_tile(a_ptrs, None, A_E5M2)
            b = fp8_tile(b_ptrs, in_cols[None, :], B_E5M2)
        else:
            in_k = offs_k < k - start
            a = fp8_tile(a_ptrs, in_k[None, :], A_E5M2)
            b = fp8_tile(b_ptrs, in_k[:, None] & in_cols[None, :], B_E5M2)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
        if SCALE_BLOCK:
            kb = start // SCALE_BLOCK
            sa = scale(sa_ptr, 0, rows_at, kb, sa_g, sa_i, sa_k, None, A_ROWS, E8M0)
            sb = scale(sb_ptr, group, cols, kb, sb_g, sb_i, sb_k, in_cols, B_ROWS, E8M0)
            acc = scaled_block(acc, a, b, sa, sb, PROMOTE_EVERY)
        else:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=PROMOTE_EVERY)
    if not SCALE_BLOCK:
        sa = scale(sa_ptr, 0, rows_at, 0, sa_g, sa_i, sa_k, None, A_ROWS)
        sb = scale(sb_ptr, group, cols, 0, sb_g, sb_i, sb_k, in_cols, B_ROWS)
        acc = acc * (sa[:, None] * sb[None, :])
    source = tl.load(source_ptr + rows_at)
    out_at = source[:, None] * stride_om + cols[None, :]
    tl.store(out_ptr + out_at, acc.to(out_ptr.dtype.element_ty), mask=(source[:, None] >= 0) & in_cols[None, :])


@autotune(_TOKENS_BY_TOKENS_TILES, key=["m", "n", "SCALE_BLOCK", "E8M0", "A_E5M2", "B_E5M2", "A_ROWS", "B_ROWS"])
@triton.jit
def _tokens_by_tokens(
    a_ptr, b_ptr, out_ptr, ends_ptr, m, n,
    stride_am, stride_ar, stride_bn, stride_br,
    sa_ptr, sa_g, sa_i, sa_k, sb_ptr, sb_g, sb_i, sb_k,
    SCALE_BLOCK: tl.constexpr, E8M0: tl.constexpr, A_ROWS: tl.constexpr, B_ROWS: tl.constexpr, A_E5M2: tl.constexpr,
    B_E5M2: tl.constexpr, PROMOTE_EVERY: tl.constexpr, GROUP_TILES: tl.constexpr, GROUP_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[g] = A_g^T B_g over group g's padded rows (bounds read on the device), A and B stored
    transposed (m and n rows, the tokens contiguous); an empty group's product is 0."""
    group = tl.program_id(1).to(tl.int64)
    pid_m, pid_n = tile_of(tl.program_id(0), tl.cdiv(m, BLOCK_M), tl.cdiv(n, BLOCK_N), GROUP_TILES)
    end = tl.load(ends_ptr + group).to(tl.int64)
    # A multiple of GROUP_ROWS, which the compiler must know to load the tokens 16 bytes at a time.
    begin = tl.multiple_of(tl.load(ends_ptr + group - 1, mask=group > 0, other=0).to(tl.int64), GROUP_ROWS)
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_m, in_n = ms < m, ns < n
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + ms[:, None].to(tl.int64) * stride_am + (begin + offs_k[None, :]) * stride_ar
    b_ptrs = b_ptr + (begin + offs_k[:, None]) * stride_br + ns[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(begin, end, BLOCK_K):  # group bounds are multiples of GROUP_ROWS: no K mask
        a = fp8_tile(a_ptrs, in_m[:, None], A_E5M2)
        b = fp8_tile(b_ptrs, in_n[None, :], B_E5M2)
        a_ptrs += BLOCK_K * stride_ar
        b_ptrs += BLOCK_K * stride_br
        if SCALE_BLOCK:
            kb = start // SCALE_BLOCK
            sa = scale(sa_ptr, group, ms, kb, sa_g, sa_i, sa_k, in_m, A_ROWS, E8M0)
            sb = scale(sb_ptr, group, ns, kb, sb_g, sb_i, sb_k, in_n, B_ROWS, E8M0)
            acc = scaled_block(acc, a, b, sa, sb, PROMOTE_EVERY)
        else:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=PROMOTE_EVERY)
    if not SCALE_BLOCK:
        sa = scale(sa_ptr, group, ms, 0, sa_g, sa_i, sa_k, in_m, A_ROWS)
        sb = scale(sb_ptr, group, ns, 0, sb_g, sb_i, sb_k, in_n, B_ROWS)
        acc = acc * (sa[:, None] * sb[None, :])
    out_at = group * m * n + ms[:, None].to(tl.int64) * n + ns[None, :]
    tl.store(out_ptr + out_at, acc.to(out_ptr.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])


def scale_block(rep: Representation) -> int:
    """The K extent of ``rep``'s block scales (SCALE_BLOCKS), 0 where its factors apply after the sum."""
    return SCALE_BLOCKS.get(rep.quantizer.gemm_input(rep.direction).family, 0)


def e8m0(rep: Representation) -> bool:
    """Whether ``rep``'s scales are E8M0 exponents (MXFP8's), not fp32."""
    return rep.quantizer.gemm_input(rep.direction).family == "mxfp8"


def _scale_rows(rep: Representation) -> int:
    """The GEMM rows one block scale covers: 128 for 128x128 tiles, 1 for 1x128 and 1x32 blocks
    (both directions: a columnwise 128x1 block is a 1x128 one of the stored transpose)."""
    return SCALE_BLOCKS["fp8_block_128x128"] if rep.quantizer.gemm_input(rep.direction).family == "fp8_block_128x128" else 1


def e5m2(rep: Representation) -> bool:
    return rep.quantizer.gemm_input(rep.direction).element == "e5m2"


def k_last(rep: Representation) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes (GEMM rows, K), scales (GEMM rows, K blocks) or None) with K contiguous in the codes
    (scaled_mm.k_last: a transposed copy of MXFP8's columnwise codes, a view of its scales). The
    codes are typed as their element, so that the tensor cores read them straight from the shared
    memory the loads fill (bytes would be cast in registers and stored back first)."""
    data, scales = scaled_mm.k_last(rep)
    return data.view(torch.float8_e5m2 if e5m2(rep) else torch.float8_e4m3fn), scales


def _expert_scales(b: Representation, codes: torch.Tensor, scales: torch.Tensor, b_group: torch.Tensor, groups: int) -> Scales:
    """B's scales for tokens x experts: B_g's GEMM rows are the output columns. Rowwise ``codes``
    (groups * n', k) have group g's rows from g * n' on; columnwise ones (cols, groups * n'),
    group g's K from g * n' on."""
    per_group = (codes.shape[0] if b.direction == ROWWISE else codes.shape[1]) // groups
    if scale_block(b):
        rows = _scale_rows(b)
        row, block = scales.stride()
        group = per_group // rows * row if b.direction == ROWWISE else per_group // scale_block(b) * block
        return Scales(scales, group, row, block, rows)
    factor = b.quantizer.grouped_factor(b, b_group).float()
    if b.direction == ROWWISE:  # (groups * n', 1): one per row of the stack
        return Scales(factor, per_group * factor.stride(0), factor.stride(0), 0)
    factor = factor.expand(groups, codes.shape[0])  # (groups, cols or 1): one per column of each group
    return Scales(factor, factor.stride(0), factor.stride(1), 0)


def _token_scales(rep: Representation, codes: torch.Tensor, scales: torch.Tensor, row_group: torch.Tensor, groups: int) -> Scales:
    """The scales of a token operand: rowwise (tokens x experts' A), its rows; columnwise
    (either side of tokens x tokens), its columns in each group."""
    if scale_block(rep):
        row, block = scales.stride()
        return Scales(scales, 0, row, block, _scale_rows(rep))
    factor = rep.quantizer.grouped_factor(rep, row_group).float()
    if rep.direction == ROWWISE:
        return Scales(factor, 0, factor.stride(0), 0)
    factor = factor.expand(groups, codes.shape[0])
    return Scales(factor, factor.stride(0), factor.stride(1), 0)


def tokens_by_experts(
    a: Representation, a_group: torch.Tensor, b: Representation, b_group: torch.Tensor, ends: torch.Tensor,
    position: torch.Tensor, n: int, out_dtype: torch.dtype,
) -> torch.Tensor:
    """(tokens, n): row t is A's padded row position[t] times its group's B (its first n GEMM
    rows: the padding dropped). A rowwise (padded rows, k); B an expert stack, rowwise (groups *
    n', k) or columnwise ((n, groups * n') with K last)."""
    groups = ends.shape[0]
    (a_codes, a_scales), (b_codes, b_scales) = k_last(a), k_last(b)
    rows, k = a_codes.shape
    out = torch.empty((position.shape[0], n), dtype=out_dtype, device=a.data.device)
    source = torch.full((rows,), -1, dtype=torch.int64, device=a.data.device)
    source.index_copy_(0, position, torch.arange(position.shape[0], device=a.data.device))
    if b.direction == ROWWISE:  # B_g[kk, col] = codes[g * n' + col, kk]
        per_group = b_codes.shape[0] // groups
        strides = (per_group * b_codes.stride(0), b_codes.stride(1), b_codes.stride(0))
    else:  # B_g[kk, col] = codes[col, g * n' + kk]
        per_group = b_codes.shape[1] // groups
        strides = (per_group * b_codes.stride(1), b_codes.stride(1), b_codes.stride(0))
    sa, sb = _token_scales(a, a_codes, a_scales, a_group, groups), _expert_scales(b, b_codes, b_scales, b_group, groups)
    grid = lambda meta: (triton.cdiv(rows, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    _tokens_by_experts[grid](
        a_codes, b_codes, out, a_group, source, ends, groups, rows, n, k,
        *a_codes.stride(), *strides, out.stride(0),
        sa.tensor, sa.group, sa.row, sa.block, sb.tensor, sb.group, sb.row, sb.block,
        SCALE_BLOCK=scale_block(a), E8M0=e8m0(a), A_ROWS=sa.rows, B_ROWS=sb.rows, A_E5M2=e5m2(a), B_E5M2=e5m2(b),
        PROMOTE_EVERY=PROMOTE_EVERY, GROUP_TILES=GROUP_TILES,
    )
    return out


def tokens_by_tokens(
    a: Representation, a_group: torch.Tensor, b: Representation, b_group: torch.Tensor, ends: torch.Tensor, m: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """(groups, m, cols of B): A_g^T B_g for each group g, both columnwise ((m', padded rows) and
    (cols, padded rows) with K last); A's first m rows (the padding dropped)."""
    groups = ends.shape[0]
    (a_codes, a_scales), (b_codes, b_scales) = k_last(a), k_last(b)
    n = b_codes.shape[0]
    out = torch.empty((groups, m, n), dtype=out_dtype, device=a.data.device)
    sa, sb = _token_scales(a, a_codes, a_scales, a_group, groups), _token_scales(b, b_codes, b_scales, b_group, groups)
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), groups)  # noqa: E731
    _tokens_by_tokens[grid](
        a_codes, b_codes, out, ends, m, n, *a_codes.stride(), *b_codes.stride(),
        sa.tensor, sa.group, sa.row, sa.block, sb.tensor, sb.group, sb.row, sb.block,
        SCALE_BLOCK=scale_block(a), E8M0=e8m0(a), A_ROWS=sa.rows, B_ROWS=sb.rows, A_E5M2=e5m2(a), B_E5M2=e5m2(b),
        PROMOTE_EVERY=PROMOTE_EVERY, GROUP_TILES=GROUP_TILES, GROUP_ROWS=GROUP_ROWS,
    )
    return out
