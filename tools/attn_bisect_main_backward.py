"""FP8 flash-attention backward for Hopper (sm_90): dQ, dK and dV with every product on the FP8
tensor cores, S and P recomputed tile by tile from the forward's logsumexp, never in memory.

Its inputs are quantized by graphquant exactly as the emulation quantizes them
(graphquant.ops.attention): Q, K and V per tensor under one scale, Q and K also transposed
(their columnwise codes), dO per tensor (rowwise and transposed), and D = rowsum(dO * O) per query row
(dO's dequantized values, the forward's O). Per (batch, query head), P and dS are quantized as
the tiles see them, with per-tensor scales known before the kernel runs (delayed scaling: the s
and dp slots' current scales):

    S^T tile = K @ Q^T                          P^T = exp2(S^T * scale_inv^2 * softmax scale * log2(e) - lse * log2(e))
    dV      += s(P)^T @ dO                      dP^T = V @ dO^T
    dS^T     = P^T * (dP^T - D)                 dK  += dp(dS)^T @ Q      (one program per key tile, over the query tiles)
    dQ      += dp(dS) @ K                       (one program per query tile, over the key tiles, S, P, dP, dS recomputed)

Every product reads operands whose inner dim is contiguous (Hopper's FP8 wgmma takes only those),
so dO^T, Q^T and K^T come as their columnwise codes. Each product sums one tile (at most 128
deep) in the tensor cores' accumulator and adds it into fp32 (as the forward's PV). The dK/dV
program records the largest |dS| it saw (what the dp slot's delayed scaling records). dK and dV
are written per query head in fp32 (grouped-query attention sums them over the group after).
Causal masks are aligned top left, as the forward's.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from graphquant.formats import fp8
from graphquant.kernels.triton_attention import kv_head, logit_scale


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """How the backward's two programs tile their work: the dK/dV program dkdv_block_n keys over
    dkdv_block_m query rows at a time, the dQ program dq_block_m query rows over dq_block_n keys
    at a time; num_warps warps and num_stages pipeline stages for both."""

    dkdv_block_m: int = 64
    dkdv_block_n: int = 64
    dq_block_m: int = 128
    dq_block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2

    def __post_init__(self) -> None:
        tiles = (16, 32, 64, 128, 256)
        blocks = (self.dkdv_block_m, self.dkdv_block_n, self.dq_block_m, self.dq_block_n)
        if any(block not in tiles for block in blocks) or self.num_warps not in (4, 8) or self.num_stages < 1:
            raise ValueError(
                f"FP8 flash attention backward: {self!r} is not a configuration: blocks one of {tiles}, num_warps 4 or 8, "
                "num_stages at least 1"
            )


# The dK/dV program holds two fp32 accumulators of its keys, so its tiles are smaller than the dQ
# program's; both fit the registers at 8 warps without spilling (ptxas for sm_90).
DEFAULT_CONFIG = BackwardConfig()
_CODES = {"e4m3": tl.float8e4nv, "e5m2": tl.float8e5}


@triton.jit
def _cast(x, scale, FP8_MAX: tl.constexpr, CODE: tl.constexpr):
    """graphquant.formats.per_tensor.quantize of an fp32 tile: one product, clamped, RNE."""
    y = x * scale
    y = tl.where(y > FP8_MAX, FP8_MAX, tl.where(y < -FP8_MAX, -FP8_MAX, y))
    return y.to(CODE, fp_downcast_rounding="rtne")


@triton.jit
def _rows(X, first, offs, valid, offs_d, HEAD_DIM: tl.constexpr):
    """Rows first + offs (0 where not valid) of a (rows, HEAD_DIM) tensor."""
    return tl.load(X + (first + offs)[:, None] * HEAD_DIM + offs_d[None, :], mask=valid[:, None], other=0.0)


@triton.jit
def _columns(XT, stride, first, offs, valid, offs_d):
    """Columns first + offs (0 where not valid) of a transposed (HEAD_DIM, stride) tensor."""
    return tl.load(XT + offs_d[:, None] * stride + (first + offs)[None, :], mask=valid[None, :], other=0.0)


@triton.jit
def _row_statistics(LSE, DELTA, first, offs, valid):
    """The rows' logsumexp in base 2 (infinite past the rows, so that their P is 0) and D."""
    lse = tl.load(LSE + first + offs, mask=valid, other=float("inf")) * 1.4426950408889634  # log2(e)
    return lse, tl.load(DELTA + first + offs, mask=valid, other=0.0)


@triton.jit
def _dkdv_tiles(
    dk, dv, ds_amax, k, v, offs_n, start, end, Q, QT, DO, DOT, LSE, DELTA, bh, seq_q, qt_stride, offs_d,
    qk_scale, dp_factor, s_scale, dp_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
    P_MAX: tl.constexpr, P_CODE: tl.constexpr, DS_MAX: tl.constexpr, DS_CODE: tl.constexpr,
):
    """Fold the query tiles [start, end) into one key tile's (dK, dV, largest |dS| per key);
    MASKED: some query rows of these tiles come before some of the keys (causal)."""
    for start_m in range(start, end, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        rows = offs_m < seq_q
        q = _rows(Q, bh * seq_q, offs_m, rows, offs_d, HEAD_DIM)
        qt = _columns(QT, qt_stride, bh * seq_q, offs_m, rows, offs_d)
        do = _rows(DO, bh * seq_q, offs_m, rows, offs_d, HEAD_DIM)
        dot = _columns(DOT, qt_stride, bh * seq_q, offs_m, rows, offs_d)
        lse, delta = _row_statistics(LSE, DELTA, bh * seq_q, offs_m, rows)
        pt = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :])
        if MASKED:
            pt = tl.where(offs_n[:, None] <= offs_m[None, :], pt, 0.0)
        dv += tl.dot(_cast(pt, s_scale, P_MAX, P_CODE), tl.trans(dot))
        dst = pt * (tl.dot(v, tl.trans(do)) * dp_factor - delta[None, :])
        ds_amax = tl.maximum(ds_amax, tl.max(dst.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 1))
        dk += tl.dot(_cast(dst, dp_scale, DS_MAX, DS_CODE), tl.trans(qt))
    return dk, dv, ds_amax


@triton.jit
def _dkdv_kernel(
    Q, QT, K, V, DO, DOT, LSE, DELTA, DK, DV, DS_AMAX_BITS, SCALES, softmax_scale, seq_q, seq_k, qt_stride,
    HEADS: tl.constexpr, GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, P_MAX: tl.constexpr, P_CODE: tl.constexpr,
    DS_MAX: tl.constexpr, DS_CODE: tl.constexpr,
):
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1).to(tl.int64)
    kv_bh = kv_head(bh, HEADS, GROUPS)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    keys = offs_n < seq_k
    # Keys past seq_k load as zeros: their dK and dV rows are not stored, their |dS| not recorded.
    k = _rows(K, kv_bh * seq_k, offs_n, keys, offs_d, HEAD_DIM)
    v = _rows(V, kv_bh * seq_k, offs_n, keys, offs_d, HEAD_DIM)
    qkv_inv, do_inv = tl.load(SCALES), tl.load(SCALES + 1)
    s_scale, s_inv, dp_scale, dp_inv = tl.load(SCALES + 2), tl.load(SCALES + 3), tl.load(SCALES + 4), tl.load(SCALES + 5)
    qk_scale = logit_scale(qkv_inv, softmax_scale)
    dp_factor = do_inv * qkv_inv

    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    ds_amax = tl.zeros([BLOCK_N], tl.int32)
    lo = 0
    if CAUSAL:  # no query row before a key sees it; the tiles starting before the last key see some keys masked
        lo = (start_n // BLOCK_M) * BLOCK_M
        diagonal_end = start_n + BLOCK_N - 1
        dk, dv, ds_amax = _dkdv_tiles(
            dk, dv, ds_amax, k, v, offs_n, lo, tl.minimum(diagonal_end, seq_q), Q, QT, DO, DOT, LSE, DELTA, bh, seq_q, qt_stride,
            offs_d, qk_scale, dp_factor, s_scale, dp_scale, HEAD_DIM, BLOCK_M, True, P_MAX, P_CODE, DS_MAX, DS_CODE,
        )
        lo = tl.cdiv(diagonal_end, BLOCK_M) * BLOCK_M
    dk, dv, ds_amax = _dkdv_tiles(
        dk, dv, ds_amax, k, v, offs_n, lo, seq_q, Q, QT, DO, DOT, LSE, DELTA, bh, seq_q, qt_stride,
        offs_d, qk_scale, dp_factor, s_scale, dp_scale, HEAD_DIM, BLOCK_M, False, P_MAX, P_CODE, DS_MAX, DS_CODE,
    )

    out = (bh * seq_k + offs_n)[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(DV + out, dv * (s_inv * do_inv), mask=keys[:, None])
    tl.store(DK + out, dk * (dp_inv * qkv_inv * softmax_scale), mask=keys[:, None])
    tl.atomic_max(DS_AMAX_BITS, tl.max(tl.where(keys, ds_amax, 0), 0))


@triton.jit
def _dq_tiles(
    dq, q, do, lse, delta, offs_m, start, end, K, KT, V, kv_bh, seq_k, kt_stride, offs_d, qk_scale, dp_factor, dp_scale,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DS_MAX: tl.constexpr, DS_CODE: tl.constexpr,
):
    """Fold the key tiles [start, end) into one query tile's dQ; MASKED: some of these keys come
    after some of the rows (causal). Keys past seq_k load as zeros, so add nothing to dQ."""
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        keys = offs_n < seq_k
        k = _rows(K, kv_bh * seq_k, offs_n, keys, offs_d, HEAD_DIM)
        kt = _columns(KT, kt_stride, kv_bh * seq_k, offs_n, keys, offs_d)
        v = _rows(V, kv_bh * seq_k, offs_n, keys, offs_d, HEAD_DIM)
        p = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse[:, None])
        if MASKED:
            p = tl.where(offs_n[None, :] <= offs_m[:, None], p, 0.0)
        ds = p * (tl.dot(do, tl.trans(v)) * dp_factor - delta[:, None])
        dq += tl.dot(_cast(ds, dp_scale, DS_MAX, DS_CODE), tl.trans(kt))
    return dq


@triton.jit
def _dq_kernel(
    Q, K, KT, V, DO, LSE, DELTA, DQ, SCALES, softmax_scale, seq_q, seq_k, kt_stride,
    HEADS: tl.constexpr, GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DS_MAX: tl.constexpr, DS_CODE: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    kv_bh = kv_head(bh, HEADS, GROUPS)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_m < seq_q
    q = _rows(Q, bh * seq_q, offs_m, rows, offs_d, HEAD_DIM)
    do = _rows(DO, bh * seq_q, offs_m, rows, offs_d, HEAD_DIM)
    lse, delta = _row_statistics(LSE, DELTA, bh * seq_q, offs_m, rows)
    qkv_inv, do_inv = tl.load(SCALES), tl.load(SCALES + 1)
    dp_scale, dp_inv = tl.load(SCALES + 4), tl.load(SCALES + 5)
    qk_scale = logit_scale(qkv_inv, softmax_scale)
    dp_factor = do_inv * qkv_inv

    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    full_end = seq_k
    if CAUSAL:  # key tiles wholly before the block's first row unmasked, then those up to its last row masked
        full_end = tl.minimum(((start_m + 1) // BLOCK_N) * BLOCK_N, seq_k)
        dq = _dq_tiles(
            dq, q, do, lse, delta, offs_m, full_end, tl.minimum(seq_k, start_m + BLOCK_M), K, KT, V, kv_bh, seq_k, kt_stride,
            offs_d, qk_scale, dp_factor, dp_scale, HEAD_DIM, BLOCK_N, True, DS_MAX, DS_CODE,
        )
    dq = _dq_tiles(
        dq, q, do, lse, delta, offs_m, 0, full_end, K, KT, V, kv_bh, seq_k, kt_stride,
        offs_d, qk_scale, dp_factor, dp_scale, HEAD_DIM, BLOCK_N, False, DS_MAX, DS_CODE,
    )

    tl.store(DQ + (bh * seq_q + offs_m)[:, None] * HEAD_DIM + offs_d[None, :], dq * (dp_inv * qkv_inv * softmax_scale), mask=rows[:, None])


def backward(
    q: torch.Tensor, qt: torch.Tensor, k: torch.Tensor, kt: torch.Tensor, v: torch.Tensor,
    do: torch.Tensor, dot: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, scales: torch.Tensor,
    softmax_scale: float, causal: bool, p_dtype: str, ds_dtype: str, config: Optional[BackwardConfig] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ (batch, heads, Lq, D), dK and dV per query head (batch, heads, Lk, D), all fp32, and the
    amax of dS (0-dim fp32)) of FP8 codes q (batch, heads, Lq, D) and its transpose qt (D, batch *
    heads * Lq), k and v (batch, kv heads, Lk, D), kt (D, batch * kv heads * Lk), do (as q) in
    its own format and dot (as qt); lse the forward's natural-log logsumexp and delta rowsum(dO *
    O), both (batch, heads, Lq) fp32; ``scales`` fp32 [qkv scale_inv, dO scale_inv, P scale,
    P scale_inv, dS scale, dS scale_inv]; P quantized to ``p_dtype``, dS to ``ds_dtype``;
    ``config`` defaults to DEFAULT_CONFIG."""
    b, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    if k.shape[3] != head_dim or v.shape != k.shape or qt.shape != (head_dim, b * heads * seq_q) or kt.shape != (head_dim, b * kv_heads * seq_k) or do.shape != q.shape or dot.shape != qt.shape:
        raise ValueError(
            f"FP8 flash attention backward: q {tuple(q.shape)}, qt {tuple(qt.shape)}, k {tuple(k.shape)}, kt {tuple(kt.shape)}, "
            f"v {tuple(v.shape)}, do {tuple(do.shape)}, dot {tuple(dot.shape)} do not fit one another"
        )
    dq = torch.empty(q.shape, device=q.device, dtype=torch.float32)
    dk = torch.empty((b, heads, seq_k, head_dim), device=q.device, dtype=torch.float32)
    dv = torch.empty_like(dk)
    ds_amax = torch.zeros((), device=q.device, dtype=torch.int32)
    q, qt, k, kt, v, do, dot, lse, delta = (t.contiguous() for t in (q, qt, k, kt, v, do, dot, lse, delta))
    groups = heads // kv_heads
    codes = dict(P_MAX=fp8.fp8_max(p_dtype), P_CODE=_CODES[p_dtype], DS_MAX=fp8.fp8_max(ds_dtype), DS_CODE=_CODES[ds_dtype])
    c = config or DEFAULT_CONFIG
    launch = dict(num_warps=c.num_warps, num_stages=c.num_stages)
    _dkdv_kernel[(triton.cdiv(seq_k, c.dkdv_block_n), b * heads)](
        q, qt, k, v, do, dot, lse, delta, dk, dv, ds_amax, scales, softmax_scale, seq_q, seq_k, qt.shape[1],
        heads, groups, head_dim, causal, c.dkdv_block_m, c.dkdv_block_n, **codes, **launch,
    )
    _dq_kernel[(triton.cdiv(seq_q, c.dq_block_m), b * heads)](
        q, k, kt, v, do, lse, delta, dq, scales, softmax_scale, seq_q, seq_k, kt.shape[1],
        heads, groups, head_dim, causal, c.dq_block_m, c.dq_block_n, codes["DS_MAX"], codes["DS_CODE"], **launch,
    )
    return dq, dk, dv, ds_amax.view(torch.float32)
