"""The Triton FP8 grouped GEMM: every group's product of two FP8 grouped representations in one
Triton launch, the scales applied inside it, the group offsets read on the device.

It multiplies the FP8 codes on the tensor cores and applies the formats' scales in fp32:
per-tensor and per-row scales (one factor per GEMM row of each operand, ``Quantizer.grouped_factor``)
once in the epilogue; DeepSeek-V3's 1x128 and 128x128 block scales to each 128-long K block's
partial product, as its recipe does; MXFP8's E8M0 scales to each 32-long block's, in the few-token
tiles alone (MX_FAMILY_PAIRS). A GEMM that keeps a recipe's fp32-accumulation contract has
its partial sums promoted from the tensor cores' accumulator into fp32 after every
fp8.PROMOTED_PRODUCTS (128) products, or every K tile where a tile is shorter
(``max_num_imprecise_acc``), as cuBLASLt's promoted FP8 GEMMs do and DeepSeek-V3's recipe asks
(within fp8.accumulation_bound's bound). A per-tensor or per-row GEMM that the recipe lets
accumulate fast (CustomRecipe.fast_accumulation) sums in the tensor cores' accumulator alone, as
torch._scaled_grouped_mm and cuBLASLt's fast accumulation do; block-scaled GEMMs always promote.
E4M3 and E5M2 on either side. The result is rounded once, to the output dtype, and written
straight to the unpadded output: no padded fp32 product, no factor tensor, no copy afterwards.

The two products of graphquant.kernels.grouped, on graphquant.formats.groups' padded layout
(every group starts at a multiple of 128 rows, so a tile of 128 rows lies in one group; the
tokens of a graph that runs fprop alone at multiples of 16, which tiles of 16 rows take):

    tokens x experts (fprop, dgrad)  out[source[r]] = A[r] @ B_g for the padded rows r of group g
    tokens x tokens (wgrad)          out[g] = A_g^T B_g over group g's padded rows (an empty group: 0)

Both operands are read with the reduction dim contiguous, as every grouped representation of
these formats stores it (rowwise data as is, columnwise data transposed). On Hopper, where
graphquant's extension runs it, the plan gives every product of whole tiles to
graphquant.kernels.grouped_fp8, promoted: the same bits as the promoted products here, faster even
than the fast ones. This kernel keeps a graph's few tokens an expert and the other GPUs.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from graphquant.formats import fp8
from graphquant.formats.groups import FEW_TOKEN_ROWS, GROUP_ROWS, GroupPadding
from graphquant.kernels import grouped_operands as operands
from graphquant.kernels.triton_launch import ceil_div
from graphquant.quantizers import ROWWISE, Representation

BACKEND = "triton fp8 grouped"
MX_BACKEND = "triton fp8 grouped, MXFP8 blocks"
# fprop and dgrad multiply activations or gradients (1x128) by weights (128x128, or 1x128), wgrad
# two 1x128 operands; per-tensor and per-row scales in any combination.
FAMILY_PAIRS = frozenset(
    {(x, y) for x in operands.ROW_SCALED for y in operands.ROW_SCALED}
    | {(x, y) for x in ("fp8_block_1x128", "fp8_block_128x128") for y in ("fp8_block_1x128", "fp8_block_128x128")}
)
# The families whose sums it leaves in the tensor cores' accumulator where the recipe allows: block
# scales always promote (as cuBLAS's block-scaled GEMMs do).
FAST_FAMILIES = frozenset(operands.ROW_SCALED)
ELEMENT_PAIRS = operands.ELEMENT_PAIRS
SCALE_BLOCK = operands.SCALE_BLOCK
MX_BLOCK = 32  # the K extent of an MXFP8 block scale (E8M0)
# MXFP8 pairs (E4M3) in the few-token tiles alone, on Hopper's FP8 tensor cores (which have no MX
# products): each 32-block's sum, which the tensor cores' accumulator takes, scaled by its two
# powers of two and added in fp32, as a GEMM the recipe lets accumulate fast may sum (backends).
MX_FAMILY_PAIRS = frozenset({("mxfp8", "mxfp8")})
PROMOTE_EVERY = fp8.PROMOTED_PRODUCTS
# The kernels' PROMOTE_EVERY for fast accumulation: None leaves tl.dot's max_num_imprecise_acc to
# Triton's FP8 default (2**30 on sm_90), above any tile's K, so that the wgmmas keep no partial
# accumulator and the tensor cores' accumulator takes the whole sum (tests/test_triton_grouped_fp8.py
# reads the PTX, benchmarks/accumulation_probe.py the results); no explicit value can, as Triton
# rejects one above a dot's K and one equal to it still promotes once a K tile.
FAST_ACCUMULATION = None


def _tile(block_m: int, block_n: int, block_k: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k}, num_warps=warps, num_stages=stages)


_WARPGROUP_ROWS = 64  # the rows of a wgmma's left operand


def _kind(block_scaled: bool, promote_every: Optional[int], token_rows: int = GROUP_ROWS, scale_block: int = SCALE_BLOCK) -> str:
    """The kind of a call, which picks its tiles: groups of tokens that start at multiples of
    fewer rows than a wgmma's product takes (FEW_TOKEN_ROWS; MXFP8's 32-column blocks a K tile
    each), block scales (whose per-block partial sums take registers: smaller tiles), or
    per-tensor / per-row factors with promoted or fast sums."""
    if token_rows < _WARPGROUP_ROWS:
        return "few tokens" if scale_block == SCALE_BLOCK else "few tokens, MX blocks"
    return "block scaled" if block_scaled else "promoted" if promote_every is not FAST_ACCUMULATION else "fast"


# Each kernel's tiles by kind, the fastest of benchmarks/grouped_gemm_sweep.py's on an H200 at an
# MoE step's shapes; an autotuner picks among a kind's by shape. Fast sums wait on no promotion,
# so their candidates add a wider tile. K tiles of one block scale where scales are per block: the
# wider tile where B's 128x128 blocks give a tile one scale (B_TILE_SCALE), the smaller where each
# of B's rows has its own (the outer product of scales takes registers). Row tiles of tokens x
# experts within the layout's alignment: 16-row tiles where groups start at multiples of 16, their
# products taken transposed (the weights a wgmma's 64-row side). A few-token product is bound by
# its weights' bytes, not by the tensor cores.
_TOKENS_BY_EXPERTS_TILES = {
    "few tokens": [_tile(FEW_TOKEN_ROWS, 128, 128, 4, 4)],
    "few tokens, MX blocks": [_tile(FEW_TOKEN_ROWS, 256, MX_BLOCK, 4, 6)],
    "block scaled": [_tile(128, 128, 128, 8, 3), _tile(64, 64, 128, 4, 3)],
    "promoted": [_tile(128, 128, 128, 8, 3)],
    "fast": [_tile(128, 128, 128, 8, 3), _tile(128, 256, 128, 8, 3)],
}
_TOKENS_BY_TOKENS_TILES = {
    "block scaled": [_tile(128, 64, 128, 4, 3)],
    "promoted": [_tile(128, 128, 128, 8, 3), _tile(64, 128, 64, 4, 4)],
    "fast": [_tile(128, 128, 128, 8, 3), _tile(64, 128, 64, 4, 4), _tile(128, 256, 128, 8, 3)],
}


def _autotune(tiles: dict[str, list[triton.Config]], key: list[str]):
    """An autotuner over the tiles of the call's kind. The interpreter runs a kernel's logic, not
    its speed: one tile there, untimed, a block-scaled one (it takes any kind but few tokens)."""
    interpreted = triton.knobs.runtime.interpret

    def of_its_kind(configs, named_args, BLOCK_SCALED, PROMOTE_EVERY, TOKEN_ROWS=GROUP_ROWS, SCALE_BLOCK=SCALE_BLOCK, **kwargs):
        kind = _kind(BLOCK_SCALED, PROMOTE_EVERY, TOKEN_ROWS, SCALE_BLOCK)
        if interpreted:
            return tiles[kind if kind.startswith("few tokens") else "block scaled"][:1]
        return tiles[kind]

    def untimed(kernel_call, quantiles):
        return [0.0] * len(quantiles)

    return triton.autotune(
        configs=[tile for kind in tiles.values() for tile in kind], key=key, prune_configs_by={"early_config_prune": of_its_kind},
        do_bench=untimed if interpreted else None,
    )


GROUP_TILES = 8  # tile rows a launch walks before the next tile column, so that B stays in L2


def _imprecise_products(args: dict) -> Optional[int]:
    """tl.dot's max_num_imprecise_acc for a launch: its PROMOTE_EVERY, or its K tile where that is
    shorter (Triton takes none above a dot's K: the sums are then promoted every K tile), or
    FAST_ACCUMULATION as it is."""
    promote_every = args["PROMOTE_EVERY"]
    return promote_every if promote_every is FAST_ACCUMULATION else min(promote_every, args["BLOCK_K"])


@triton.jit
def _fp8_tile(ptrs, mask, E5M2: tl.constexpr):
    """FP8 codes (masked lanes +0; mask None: none masked) read as E4M3 or E5M2."""
    if mask is None:
        codes = tl.load(ptrs)
    else:
        codes = tl.load(ptrs, mask=mask, other=0.0)
    return codes.to(tl.float8e5 if E5M2 else tl.float8e4nv, bitcast=True)


@triton.jit
def _scale(ptr, group, i, kb, stride_g, stride_i, stride_k, mask, ROWS: tl.constexpr, E8M0: tl.constexpr = False):
    """The scales of GEMM rows ``i`` of ``group`` in K block ``kb`` (see grouped_operands.Scales); 0 where masked
    (mask None: none masked). E8M0: stored as MXFP8's exponent bytes, 2^(e - 127) (255: NaN)."""
    at = group * stride_g + (i // ROWS).to(tl.int64) * stride_i + kb * stride_k
    if mask is None:
        scales = tl.load(ptr + at)
    else:
        scales = tl.load(ptr + at, mask=mask, other=0)
    if E8M0:
        e = scales.to(tl.int32)
        bits = tl.where(e == 0, 0x400000, tl.where(e == 255, 0x7FC00000, e << 23))  # 2^-127 a subnormal
        scales = bits.to(tl.float32, bitcast=True)
    return scales


@triton.jit
def tile_of(pid, tiles_m, tiles_n, GROUP_TILES: tl.constexpr):
    """(tile row, tile column) of program ``pid``, GROUP_TILES tile rows per column in turn."""
    width = GROUP_TILES * tiles_n
    first = (pid // width) * GROUP_TILES
    height = tl.minimum(tiles_m - first, GROUP_TILES)
    return first + (pid % width) % height, (pid % width) // height


@triton.jit
def _dot(a, b, IMPRECISE: tl.constexpr, WEIGHTS_LEFT: tl.constexpr, acc=None):
    """a @ b (+ acc) in the accumulator's orientation: with WEIGHTS_LEFT, (a @ b)^T = b^T a^T, the
    weights b the tensor cores' left operand (a wgmma's 64 rows or more) and a's few tokens their
    right, which a wgmma takes from 8."""
    if WEIGHTS_LEFT:
        product = tl.dot(tl.trans(b), tl.trans(a), acc, max_num_imprecise_acc=IMPRECISE)
    else:
        product = tl.dot(a, b, acc, max_num_imprecise_acc=IMPRECISE)
    return product


@triton.jit
def _outer(sa, sb, WEIGHTS_LEFT: tl.constexpr):
    """The scales of a @ b's elements in _dot's orientation."""
    if WEIGHTS_LEFT:
        scales = sb[:, None] * sa[None, :]
    else:
        scales = sa[:, None] * sb[None, :]
    return scales


@triton.jit
def _of_rows(scales, WEIGHTS_LEFT: tl.constexpr):
    """Scales of a's rows (b's one scale for the tile already in them) in _dot's orientation."""
    if WEIGHTS_LEFT:
        of_rows = scales[None, :]
    else:
        of_rows = scales[:, None]
    return of_rows


@_autotune(
    _TOKENS_BY_EXPERTS_TILES,
    key=["n", "k", "BLOCK_SCALED", "PROMOTE_EVERY", "A_E5M2", "B_E5M2", "A_ROWS", "B_ROWS", "TOKEN_ROWS", "SCALE_BLOCK"],
)
@triton.heuristics(
    {
        "EVEN_K": lambda args: args["k"] % args["BLOCK_K"] == 0,
        "IMPRECISE": _imprecise_products,
        "WEIGHTS_LEFT": lambda args: args["BLOCK_M"] < _WARPGROUP_ROWS,
        "B_TILE_SCALE": lambda args: args["BLOCK_SCALED"] and args["B_ROWS"] % args["BLOCK_N"] == 0,
    }
)
@triton.jit
def _tokens_by_experts(
    a_ptr, b_ptr, out_ptr, row_group_ptr, source_ptr, ends_ptr, groups, rows, n, k,
    stride_am, stride_ak, stride_bg, stride_bk, stride_bn, stride_om,
    sa_ptr, sa_g, sa_i, sa_k, sb_ptr, sb_g, sb_i, sb_k,
    BLOCK_SCALED: tl.constexpr, A_ROWS: tl.constexpr, B_ROWS: tl.constexpr, A_E5M2: tl.constexpr, B_E5M2: tl.constexpr,
    PROMOTE_EVERY: tl.constexpr, SCALE_BLOCK: tl.constexpr, E8M0: tl.constexpr, GROUP_TILES: tl.constexpr,
    TOKEN_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    IMPRECISE: tl.constexpr, WEIGHTS_LEFT: tl.constexpr, B_TILE_SCALE: tl.constexpr,
):
    """out[source[r], :] = A[r, :] @ B_g for the padded rows r of one tile (g: their group, read
    once a tile; the groups start at multiples of TOKEN_ROWS, which BLOCK_M divides); tiles past
    the last group's end hold no rows and return at once. A tile of fewer rows than a wgmma's
    sums its products transposed (WEIGHTS_LEFT, _dot). B_TILE_SCALE: B's block scales span the
    tile's columns (128x128 blocks), so each K block's partial sum takes B's one scale, read
    once, and A's per row: one multiply-add an element, not an outer product of scales too."""
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
    if WEIGHTS_LEFT:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        if EVEN_K:
            a = _fp8_tile(a_ptrs, None, A_E5M2)
            b = _fp8_tile(b_ptrs, in_cols[None, :], B_E5M2)
        else:
            in_k = offs_k < k - start
            a = _fp8_tile(a_ptrs, in_k[None, :], A_E5M2)
            b = _fp8_tile(b_ptrs, in_k[:, None] & in_cols[None, :], B_E5M2)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
        if BLOCK_SCALED:
            kb = start // SCALE_BLOCK
            sa = _scale(sa_ptr, 0, rows_at, kb, sa_g, sa_i, sa_k, None, A_ROWS, E8M0)
            if B_TILE_SCALE:
                sb = _scale(sb_ptr, group, pid_n * BLOCK_N, kb, sb_g, sb_i, sb_k, None, B_ROWS)
                acc += _dot(a, b, IMPRECISE, WEIGHTS_LEFT) * _of_rows(sa * sb, WEIGHTS_LEFT)
            else:
                sb = _scale(sb_ptr, group, cols, kb, sb_g, sb_i, sb_k, in_cols, B_ROWS, E8M0)
                acc += _dot(a, b, IMPRECISE, WEIGHTS_LEFT) * _outer(sa, sb, WEIGHTS_LEFT)
        else:
            acc = _dot(a, b, IMPRECISE, WEIGHTS_LEFT, acc)
    if WEIGHTS_LEFT:
        acc = tl.trans(acc)
    if not BLOCK_SCALED:
        sa = _scale(sa_ptr, 0, rows_at, 0, sa_g, sa_i, sa_k, None, A_ROWS)
        sb = _scale(sb_ptr, group, cols, 0, sb_g, sb_i, sb_k, in_cols, B_ROWS)
        acc = acc * (sa[:, None] * sb[None, :])
    source = tl.load(source_ptr + rows_at)
    out_at = source[:, None] * stride_om + cols[None, :]
    tl.store(out_ptr + out_at, acc.to(out_ptr.dtype.element_ty), mask=(source[:, None] >= 0) & in_cols[None, :])


@_autotune(_TOKENS_BY_TOKENS_TILES, key=["m", "n", "BLOCK_SCALED", "PROMOTE_EVERY", "A_E5M2", "B_E5M2", "A_ROWS", "B_ROWS"])
@triton.heuristics({"IMPRECISE": _imprecise_products})
@triton.jit
def _tokens_by_tokens(
    a_ptr, b_ptr, out_ptr, ends_ptr, m, n,
    stride_am, stride_ar, stride_bn, stride_br,
    sa_ptr, sa_g, sa_i, sa_k, sb_ptr, sb_g, sb_i, sb_k,
    BLOCK_SCALED: tl.constexpr, A_ROWS: tl.constexpr, B_ROWS: tl.constexpr, A_E5M2: tl.constexpr, B_E5M2: tl.constexpr,
    PROMOTE_EVERY: tl.constexpr, SCALE_BLOCK: tl.constexpr, GROUP_TILES: tl.constexpr, GROUP_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IMPRECISE: tl.constexpr,
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
        a = _fp8_tile(a_ptrs, in_m[:, None], A_E5M2)
        b = _fp8_tile(b_ptrs, in_n[None, :], B_E5M2)
        a_ptrs += BLOCK_K * stride_ar
        b_ptrs += BLOCK_K * stride_br
        if BLOCK_SCALED:
            kb = start // SCALE_BLOCK
            sa = _scale(sa_ptr, group, ms, kb, sa_g, sa_i, sa_k, in_m, A_ROWS)
            sb = _scale(sb_ptr, group, ns, kb, sb_g, sb_i, sb_k, in_n, B_ROWS)
            acc += tl.dot(a, b, max_num_imprecise_acc=IMPRECISE) * (sa[:, None] * sb[None, :])
        else:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=IMPRECISE)
    if not BLOCK_SCALED:
        sa = _scale(sa_ptr, group, ms, 0, sa_g, sa_i, sa_k, in_m, A_ROWS)
        sb = _scale(sb_ptr, group, ns, 0, sb_g, sb_i, sb_k, in_n, B_ROWS)
        acc = acc * (sa[:, None] * sb[None, :])
    out_at = group * m * n + ms[:, None].to(tl.int64) * n + ns[None, :]
    tl.store(out_ptr + out_at, acc.to(out_ptr.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])


def tokens_by_experts(
    a: Representation, b: Representation, b_group: torch.Tensor, tokens: GroupPadding, token_rows: int, n: int,
    out_dtype: torch.dtype, promote_every: Optional[int],
) -> torch.Tensor:
    """(tokens, n): row t is A's padded row tokens.position[t] times its group's B (its first n
    GEMM rows: the padding dropped). A rowwise (padded rows, k) in the layout ``tokens``, whose
    groups start at multiples of ``token_rows`` (GROUP_ROWS or FEW_TOKEN_ROWS); B an
    expert stack, rowwise (groups * n', k) or columnwise, stored transposed (n, groups * n').
    promote_every: the products summed in the tensor cores' accumulator before fp32 takes them
    (PROMOTE_EVERY), or FAST_ACCUMULATION: all of them."""
    if operands.mx(a) and token_rows >= _WARPGROUP_ROWS:
        raise ValueError(f"{BACKEND}: MXFP8 takes tokens of at most {_WARPGROUP_ROWS - 1} rows a group, not {token_rows} (MX_FAMILY_PAIRS)")
    groups, (rows, k) = tokens.groups, a.data.shape
    out = torch.empty((tokens.position.shape[0], n), dtype=out_dtype, device=a.data.device)
    if b.direction == ROWWISE:  # B_g[kk, col] = data[g * n' + col, kk]
        per_group = b.data.shape[0] // groups
        strides = (per_group * b.data.stride(0), b.data.stride(1), b.data.stride(0))
    else:  # B_g[kk, col] = data[col, g * n' + kk]
        per_group = b.data.shape[1] // groups
        strides = (per_group * b.data.stride(1), b.data.stride(1), b.data.stride(0))
    sa, sb = operands.token_scales(a, tokens.row_group, groups), operands.expert_scales(b, b_group, groups)
    grid = lambda meta: (ceil_div(rows, meta["BLOCK_M"]) * ceil_div(n, meta["BLOCK_N"]),)  # noqa: E731
    _tokens_by_experts[grid](
        operands.codes(a), operands.codes(b), out, tokens.row_group, tokens.source, tokens.ends, groups, rows, n, k,
        *a.data.stride(), *strides, out.stride(0),
        sa.tensor, sa.group, sa.row, sa.block, sb.tensor, sb.group, sb.row, sb.block,
        BLOCK_SCALED=operands.block_scaled(a), A_ROWS=sa.rows, B_ROWS=sb.rows, A_E5M2=operands.e5m2(a), B_E5M2=operands.e5m2(b),
        PROMOTE_EVERY=promote_every, SCALE_BLOCK=MX_BLOCK if operands.mx(a) else SCALE_BLOCK, E8M0=operands.mx(a), GROUP_TILES=GROUP_TILES,
        TOKEN_ROWS=token_rows,
    )
    return out


def tokens_by_tokens(
    a: Representation, a_group: torch.Tensor, b: Representation, b_group: torch.Tensor, ends: torch.Tensor, m: int,
    out_dtype: torch.dtype, promote_every: Optional[int],
) -> torch.Tensor:
    """(groups, m, cols of B): A_g^T B_g for each group g, both columnwise (stored transposed:
    (m', padded rows) and (cols, padded rows)); A's first m rows (the padding dropped);
    promote_every as tokens_by_experts takes it."""
    groups = ends.shape[0]
    n = b.data.shape[0]
    out = torch.empty((groups, m, n), dtype=out_dtype, device=a.data.device)
    sa, sb = operands.token_scales(a, a_group, groups), operands.token_scales(b, b_group, groups)
    grid = lambda meta: (ceil_div(m, meta["BLOCK_M"]) * ceil_div(n, meta["BLOCK_N"]), groups)  # noqa: E731
    _tokens_by_tokens[grid](
        operands.codes(a), operands.codes(b), out, ends, m, n, *a.data.stride(), *b.data.stride(),
        sa.tensor, sa.group, sa.row, sa.block, sb.tensor, sb.group, sb.row, sb.block,
        BLOCK_SCALED=operands.block_scaled(a), A_ROWS=sa.rows, B_ROWS=sb.rows, A_E5M2=operands.e5m2(a), B_E5M2=operands.e5m2(b),
        PROMOTE_EVERY=promote_every, SCALE_BLOCK=SCALE_BLOCK, GROUP_TILES=GROUP_TILES, GROUP_ROWS=GROUP_ROWS,
    )
    return out
