"""The native MXFP8 GEMM for GPUs with FP8 tensor cores but no block-scaled ones (Hopper, Ada):
out (m, n) = A @ B^T (+ bias) for two MXFP8 operands of any shape and either direction.

It multiplies the E4M3 (or E5M2) codes on the FP8 tensor cores one 32-long K block at a time (one
wgmma) and multiplies each block's partial product by its two E8M0 scales in fp32 before it joins
the fp32 accumulator: the numerics of graphquant.kernels.triton_grouped_fp8's block-scaled path,
whose jit helpers it runs (the products of codes are exact; a block's sum of 32 is the tensor
cores' and is promoted into fp32 after it; the scales' edge cases are stated there). So
|error| <= 2^-9 sum_k |a b| per output before its one rounding to the output dtype, the bound of
cuBLASLt's promoted FP8 GEMMs (tests/test_gemm_backends.py).

Both operands are read with the reduction dim contiguous (triton_grouped_fp8.k_last): rowwise
MXFP8 as stored, columnwise MXFP8 (stored as the tensor is, 32x1 blocks: dgrad's weight, wgrad's
two operands) copied transposed first. MXFP8's reduction dim is always a multiple of 32 (the
format does not pad); rows and columns past the edges are not stored.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from graphquant.kernels.triton_grouped_fp8 import (
    ELEMENT_PAIRS,
    GROUP_TILES,
    PROMOTE_EVERY,
    SCALE_BLOCKS,
    autotune,
    e5m2,
    fp8_tile,
    k_last,
    scale,
    scaled_block,
    tile_of,
)
from graphquant.quantizers import Representation

BACKEND = "triton mxfp8 (fp8 tensor cores)"
FAMILY_PAIRS = frozenset({("mxfp8", "mxfp8")})
# The most rows of A the plan gives it (None: any): where set, the emulation's bf16 GEMM is faster past them.
MAX_ROWS: Optional[int] = None
SCALE_BLOCK = SCALE_BLOCKS["mxfp8"]


def _tile(block_m: int, block_n: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": SCALE_BLOCK}, num_warps=warps, num_stages=stages)


# The tiles an autotuner picks from, per shape class (ROWS: m's power of two up to 4096, n, k):
# one scale block a step; narrow ones make programs enough for every SM at few rows, and those of
# few registers let two programs share an SM (one's products run while the other scales its
# sums: a program waits for each wgmma before it scales the block). The interpreter takes the first.
TILES = [_tile(128, 128, 8, 4), _tile(64, 128, 8, 4), _tile(64, 128, 4, 6), _tile(128, 64, 4, 6), _tile(64, 64, 4, 6), _tile(64, 32, 4, 8)]


@autotune({SCALE_BLOCK: TILES}, key=["ROWS", "n", "k", "A_E5M2", "B_E5M2"])
@triton.jit
def _gemm(
    a_ptr, b_ptr, out_ptr, bias_ptr, m, n, k,
    stride_am, stride_ak, stride_bn, stride_bk, stride_om,
    sa_ptr, sa_i, sa_k, sb_ptr, sb_i, sb_k, ROWS,
    HAS_BIAS: tl.constexpr, A_E5M2: tl.constexpr, B_E5M2: tl.constexpr, PROMOTE_EVERY: tl.constexpr,
    SCALE_BLOCK: tl.constexpr, GROUP_TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One BLOCK_M x BLOCK_N tile of out = A @ B^T (+ bias), B read as B^T's (k, n) tile. Rows and
    columns past the edges load those at the start again (in bounds, no load masks) and are not
    stored. ROWS: the autotuner's class of m, unused here."""
    pid_m, pid_n = tile_of(tl.program_id(0), tl.cdiv(m, BLOCK_M), tl.cdiv(n, BLOCK_N), GROUP_TILES)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_in, cols_in = rows % m, cols % n
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows_in[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + cols_in[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, k // BLOCK_K):
        a = fp8_tile(a_ptrs, None, A_E5M2)
        b = fp8_tile(b_ptrs, None, B_E5M2)
        sa = scale(sa_ptr, 0, rows_in, kb, 0, sa_i, sa_k, None, 1, True)
        sb = scale(sb_ptr, 0, cols_in, kb, 0, sb_i, sb_k, None, 1, True)
        acc = scaled_block(acc, a, b, sa, sb, PROMOTE_EVERY)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols_in).to(tl.float32)[None, :]
    out_at = rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out_ptr + out_at, acc.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < m) & (cols[None, :] < n))


def gemm(a: Representation, b: Representation, out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out (m, n) = A @ B^T (+ bias, added in fp32 before the one rounding to ``out_dtype``) of two
    MXFP8 representations, each rowwise or columnwise."""
    (a_codes, a_scales), (b_codes, b_scales) = k_last(a), k_last(b)
    (m, k), n = a_codes.shape, b_codes.shape[0]
    if b_codes.shape[1] != k or k % SCALE_BLOCK:
        raise ValueError(
            f"the MXFP8 GEMM multiplies (m, k) by (n, k) with k a multiple of {SCALE_BLOCK}; got "
            f"{tuple(a_codes.shape)} by {tuple(b_codes.shape)} ({a.quantizer.direction_spec(a.direction)} x "
            f"{b.quantizer.direction_spec(b.direction)})"
        )
    out = torch.empty((m, n), dtype=out_dtype, device=a.data.device)
    if out.numel() == 0 or k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    _gemm[grid](
        a_codes, b_codes, out, out if bias is None else bias, m, n, k,
        *a_codes.stride(), *b_codes.stride(), out.stride(0),
        a_scales, *a_scales.stride(), b_scales, *b_scales.stride(), min(triton.next_power_of_2(m), 4096),
        HAS_BIAS=bias is not None, A_E5M2=e5m2(a), B_E5M2=e5m2(b), PROMOTE_EVERY=PROMOTE_EVERY,
        SCALE_BLOCK=SCALE_BLOCK, GROUP_TILES=GROUP_TILES,
    )
    return out
