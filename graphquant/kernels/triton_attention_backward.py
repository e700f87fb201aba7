"""FP8 flash-attention backward for Hopper (sm_90): dQ, dK and dV with every product on the FP8
tensor cores, S and P recomputed tile by tile from the forward's logsumexp, never in memory.

Its inputs are quantized by graphquant exactly as the emulation quantizes them
(graphquant.ops.attention): Q, K and V per tensor under one scale, Q and K also transposed
(their columnwise codes), dO per tensor (rowwise and transposed), and D = rowsum(dO * O) per query row
(dO's dequantized values, the forward's O). Per (batch, query head), P and dS are quantized as
the tiles see them, with per-tensor scales known before the kernel runs (P's: the s format's for
its bound, an amax of 1; dS's: the dp slot's delayed scale).

One program per key tile walks the query tiles, so each tile pair's S, P, dP and dS are computed
once, in five products:

    S^T tile = K @ Q^T                          P^T = exp2(S^T * scale_inv^2 * softmax scale * log2(e) - lse * log2(e))
    dV      += s(P)^T @ dO                      dP^T = V @ dO^T
    dS^T     = P^T * (dP^T - D)                 dK  += dp(dS)^T @ Q
    dQ      += dp(dS) @ K                       (added into a zeroed fp32 dQ by atomic adds: many key tiles share a query tile)

dK and dV stay in the program's registers; dQ's tiles arrive from every key tile of the row in
no fixed order, so dQ's last bits may differ from run to run, within the bound the tests check:
each key tile's product is scaled once and added in fp32, in some order, so n tiles' sum is
within n fp32 roundings of their absolute sum, as a sequential sum scaled at the end is.

Every product reads operands whose inner dim is contiguous (Hopper's FP8 wgmma takes only those),
so dO^T, Q^T and K^T come as their columnwise codes; dS, the one operand made in registers, is
transposed there. Each product sums one tile (at most 128 deep) in the tensor cores' accumulator
and adds it into fp32 (as the forward's PV). The program records the largest |dS| it saw (what
the dp slot's delayed scaling records). Without groups each program stores its keys' rows of dK
and dV in fp32, which ``backward`` rounds once to the gradient's dtype. Under grouped-query attention dK and dV come out
summed over each key/value head's query heads, in fp32: a program walks one query head and adds
its dK and dV into the group's by atomic adds (in some order, one more fp32 rounding a query
head), so that the programs running at one moment share the few query heads whose dQ they add
into (and whose Q and dO they read), as without groups, and the causal launch's last wave is as
short. dQ, a sum of atomic adds that no program sees whole, is fp32 too: the caller rounds these
sums. Causal masks are aligned top left, as the forward's.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from graphquant.kernels.triton_attention import logit_scale
from graphquant.kernels.triton_launch import ceil_div, launch
from graphquant.kernels.triton_scales import fp8_codes


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """How the backward tiles its work: a program per block_n keys of a (batch, query head),
    walking the query rows block_m at a time in num_stages pipeline stages, on num_warps warps.
    Each tile is the depth of a product the tensor cores sum in their narrow accumulator (dK and
    dV over block_m rows, dQ over block_n keys), so at most 128, the depth the tests' bound
    covers, and at least 32, one FP8 wgmma's. stagger: each program starts its walk of the query
    tiles that see all its keys at a different one (its key tile's index, wrapping around), so
    that the programs of one head do not add into the same dQ tile at the same moment.

    Under grouped-query attention each program adds its dK and dV into its key/value head's by
    atomic adds."""

    block_m: int = 64
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3
    stagger: bool = False

    def __post_init__(self) -> None:
        tiles = (32, 64, 128)
        if self.block_m not in tiles or self.block_n not in tiles or self.num_warps not in (4, 8, 16) or self.num_stages < 1:
            raise ValueError(
                f"FP8 flash attention backward: {self!r} is not a configuration: block_m and block_n one of {tiles}, "
                "num_warps 4, 8 or 16, num_stages at least 1"
            )


# The H200's best of benchmarks/attention_tune.py --pass bwd at head dim 128 (NOTES.md).
DEFAULT_CONFIG = BackwardConfig()
CODES = {"e4m3": tl.float8e4nv, "e5m2": tl.float8e5}


@triton.jit
def transposed_p(st, lse, qk_scale):
    """P^T of a tile from S^T = K @ Q^T (keys down, query rows across) and the rows' base-2 logsumexp."""
    return tl.math.exp2(st * qk_scale - lse[None, :])


@triton.jit
def transposed_ds(pt, dpt, delta, dp_factor):
    """dS^T = P^T * (dP^T - D) of a tile, dP^T = V @ dO^T of the codes (dequantized by dp_factor)."""
    return pt * (dpt * dp_factor - delta[None, :])


@triton.jit
def abs_max(ds_amax, dst):
    """The largest |dS| each key has seen, NaN above all (as torch.amax): one max a value, the
    absolute value an operand modifier of it."""
    return _nan_max(ds_amax, tl.reduce(tl.abs(dst), 1, _nan_max))


@triton.jit
def _nan_max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def add_amax(DS_AMAX_BITS, ds_amax, keys):
    """Add the program's keys' largest |dS| (``abs_max``) into the float32 amax at DS_AMAX_BITS,
    by an integer atomic max of its bits (a NaN's above infinity's)."""
    tl.atomic_max(DS_AMAX_BITS, tl.reduce(tl.where(keys, ds_amax, 0.0), 0, _nan_max).to(tl.int32, bitcast=True))


@triton.jit
def _rows(X, first, offs, valid, offs_d, HEAD_DIM: tl.constexpr):
    """Rows first + offs (0 where not valid) of a (rows, HEAD_DIM) tensor."""
    return tl.load(X + (first + offs)[:, None] * HEAD_DIM + offs_d[None, :], mask=valid[:, None], other=0.0)


@triton.jit
def _columns(XT, stride, first, offs, valid, offs_d):
    """Columns first + offs (0 where not valid) of a transposed (HEAD_DIM, stride) tensor."""
    return tl.load(XT + offs_d[:, None] * stride + (first + offs)[None, :], mask=valid[None, :], other=0.0)


@triton.jit
def _query_tiles(
    dk, dv, ds_amax, k, v, kt, offs_n, start, end, Q, QT, DO, DOT, LSE, DELTA, DQ, bh, seq_q, seq_k, qt_stride, offs_d,
    qk_scale, dp_factor, grad_factor, s_scale, dp_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, P_CODE: tl.constexpr, DS_CODE: tl.constexpr,
):
    """Fold the query tiles [start, end) into one key tile's (dK, dV, largest |dS| per key) and
    add their dQ tiles into DQ; MASKED: some keys of the tile are past seq_k or (CAUSAL) after
    some of these rows. Rows past seq_q have an infinite logsumexp, so P and dS are 0 there."""
    first = bh * seq_q
    for start_m in range(start, end, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        rows = offs_m < seq_q
        q = _rows(Q, first, offs_m, rows, offs_d, HEAD_DIM)
        qt = _columns(QT, qt_stride, first, offs_m, rows, offs_d)
        do = _rows(DO, first, offs_m, rows, offs_d, HEAD_DIM)
        dot = _columns(DOT, qt_stride, first, offs_m, rows, offs_d)
        lse = tl.load(LSE + first + offs_m, mask=rows, other=float("inf")) * 1.4426950408889634  # log2(e)
        delta = tl.load(DELTA + first + offs_m, mask=rows, other=0.0)
        st = tl.dot(k, tl.trans(q))
        dpt = tl.dot(v, tl.trans(do))
        pt = transposed_p(st, lse, qk_scale)
        if MASKED:
            visible = offs_n[:, None] < seq_k
            if CAUSAL:
                visible = visible & (offs_n[:, None] <= offs_m[None, :])
            pt = tl.where(visible, pt, 0.0)
        dst = transposed_ds(pt, dpt, delta, dp_factor)
        dv += tl.dot(fp8_codes(pt, s_scale, P_CODE), tl.trans(dot))
        ds_amax = abs_max(ds_amax, dst)
        dst8 = fp8_codes(dst, dp_scale, DS_CODE)
        dk += tl.dot(dst8, tl.trans(qt))
        dq = tl.dot(tl.trans(dst8), tl.trans(kt)) * grad_factor
        tl.atomic_add(DQ + (first + offs_m)[:, None] * HEAD_DIM + offs_d[None, :], dq, mask=rows[:, None], sem="relaxed")
    return dk, dv, ds_amax


@triton.jit
def _backward_kernel(
    Q, QT, K, KT, V, DO, DOT, LSE, DELTA, DQ, DK, DV, DS_AMAX_BITS, SCALES, softmax_scale, seq_q, seq_k, qt_stride, kt_stride,
    GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGGER: tl.constexpr, P_CODE: tl.constexpr, DS_CODE: tl.constexpr,
):
    # A one-dimensional grid, key tiles fastest (the order of a (key tiles, heads) grid). The two
    # spellings of (tile, head) are the same numbers; the query loops sit at the register limit, and
    # ptxas spills several times as much in them with the other spelling of each case.
    tiles = tl.cdiv(seq_k, BLOCK_N)
    if CAUSAL:
        tile = tl.program_id(0) % tiles
        bh = (tl.program_id(0) // tiles).to(tl.int64)  # (batch, query head)
    else:
        head = tl.program_id(0) // tiles
        tile = tl.program_id(0) - head * tiles
        bh = head.to(tl.int64)
    start_n = tile * BLOCK_N
    kv_bh = bh // GROUPS
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    keys = offs_n < seq_k
    # Keys past seq_k load as zeros and are masked: their dK and dV rows are not stored, their |dS| not recorded.
    k = _rows(K, kv_bh * seq_k, offs_n, keys, offs_d, HEAD_DIM)
    v = _rows(V, kv_bh * seq_k, offs_n, keys, offs_d, HEAD_DIM)
    kt = _columns(KT, kt_stride, kv_bh * seq_k, offs_n, keys, offs_d)
    qkv_inv, do_inv = tl.load(SCALES), tl.load(SCALES + 1)
    s_scale, s_inv, dp_scale, dp_inv = tl.load(SCALES + 2), tl.load(SCALES + 3), tl.load(SCALES + 4), tl.load(SCALES + 5)
    qk_scale = logit_scale(qkv_inv, softmax_scale)
    dp_factor = do_inv * qkv_inv
    grad_factor = dp_inv * qkv_inv * softmax_scale

    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    ds_amax = tl.zeros([BLOCK_N], tl.float32)
    # Query tiles [lo, masked_end) see some of the keys masked, the rest none: under a causal mask no
    # row before start_n sees a key, and rows from start_n + BLOCK_N - 1 on see all; a key tile
    # past seq_k is masked throughout.
    lo = 0
    masked_end = 0
    if CAUSAL:
        lo = (start_n // BLOCK_M) * BLOCK_M
        masked_end = start_n + BLOCK_N - 1
    if start_n + BLOCK_N > seq_k:
        masked_end = seq_q
    masked_end = tl.maximum(tl.minimum(masked_end, seq_q), lo)
    # The tiles every row of which sees all the keys: [split, seq_q), then (STAGGER) [unmasked, split).
    unmasked = lo + tl.cdiv(masked_end - lo, BLOCK_M) * BLOCK_M
    split = unmasked
    if STAGGER:
        split += (tile * BLOCK_M) % tl.maximum(tl.cdiv(seq_q - unmasked, BLOCK_M) * BLOCK_M, 1)
    dk, dv, ds_amax = _query_tiles(
        dk, dv, ds_amax, k, v, kt, offs_n, lo, masked_end, Q, QT, DO, DOT, LSE, DELTA, DQ, bh, seq_q, seq_k, qt_stride, offs_d,
        qk_scale, dp_factor, grad_factor, s_scale, dp_scale, HEAD_DIM, BLOCK_M, True, CAUSAL, P_CODE, DS_CODE,
    )
    dk, dv, ds_amax = _query_tiles(
        dk, dv, ds_amax, k, v, kt, offs_n, split, seq_q, Q, QT, DO, DOT, LSE, DELTA, DQ, bh, seq_q, seq_k, qt_stride, offs_d,
        qk_scale, dp_factor, grad_factor, s_scale, dp_scale, HEAD_DIM, BLOCK_M, False, CAUSAL, P_CODE, DS_CODE,
    )
    if STAGGER:
        dk, dv, ds_amax = _query_tiles(
            dk, dv, ds_amax, k, v, kt, offs_n, unmasked, split, Q, QT, DO, DOT, LSE, DELTA, DQ, bh, seq_q, seq_k, qt_stride,
            offs_d, qk_scale, dp_factor, grad_factor, s_scale, dp_scale, HEAD_DIM, BLOCK_M, False, CAUSAL, P_CODE, DS_CODE,
        )

    out = (kv_bh * seq_k + offs_n)[:, None] * HEAD_DIM + offs_d[None, :]
    if GROUPS == 1:
        tl.store(DV + out, dv * (s_inv * do_inv), mask=keys[:, None])
        tl.store(DK + out, dk * grad_factor, mask=keys[:, None])
    else:  # one query head's share of its key/value head's
        tl.atomic_add(DV + out, dv * (s_inv * do_inv), mask=keys[:, None], sem="relaxed")
        tl.atomic_add(DK + out, dk * grad_factor, mask=keys[:, None], sem="relaxed")
    add_amax(DS_AMAX_BITS, ds_amax, keys)


def prepared(
    q: torch.Tensor, qt: torch.Tensor, k: torch.Tensor, kt: torch.Tensor, v: torch.Tensor,
    do: torch.Tensor, dot: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, grad_dtype: torch.dtype,
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """The outputs a backward fills (dQ, dK, dV and the bits of dS's amax: see ``backward``) and
    its inputs contiguous; refuses codes that do not fit one another."""
    b, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    if heads % kv_heads or k.shape[3] != head_dim or v.shape != k.shape or qt.shape != (head_dim, b * heads * seq_q) or kt.shape != (head_dim, b * kv_heads * seq_k) or do.shape != q.shape or dot.shape != qt.shape:
        raise ValueError(
            f"FP8 flash attention backward: q {tuple(q.shape)}, qt {tuple(qt.shape)}, k {tuple(k.shape)}, kt {tuple(kt.shape)}, "
            f"v {tuple(v.shape)}, do {tuple(do.shape)}, dot {tuple(dot.shape)} do not fit one another"
        )
    dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    # dK and dV: stored whole in the gradient's dtype, or (grouped) added into in fp32
    allocate, kv_dtype = (torch.empty, grad_dtype) if heads == kv_heads else (torch.zeros, torch.float32)
    dk = allocate((b, kv_heads, seq_k, head_dim), device=q.device, dtype=kv_dtype)
    dv = allocate(dk.shape, device=q.device, dtype=kv_dtype)
    ds_amax = torch.zeros((), device=q.device, dtype=torch.int32)
    return (dq, dk, dv, ds_amax), tuple(t.contiguous() for t in (q, qt, k, kt, v, do, dot, lse, delta))


def backward(
    q: torch.Tensor, qt: torch.Tensor, k: torch.Tensor, kt: torch.Tensor, v: torch.Tensor,
    do: torch.Tensor, dot: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, scales: torch.Tensor,
    softmax_scale: float, causal: bool, p_dtype: str, ds_dtype: str, grad_dtype: torch.dtype,
    config: Optional[BackwardConfig] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ (batch, heads, Lq, D) in fp32, dK and dV (batch, kv heads, Lk, D) in ``grad_dtype``
    (each element its fp32 value rounded once), or in fp32 under grouped-query attention (their
    sums over the groups), and the amax of dS (0-dim fp32)) of FP8 codes q
    (batch, heads, Lq, D) and its transpose qt (D, batch * heads * Lq), k and v (batch, kv heads,
    Lk, D), kt (D, batch * kv heads * Lk), do (as q) in its own format and dot (as qt); lse the
    forward's natural-log logsumexp and delta rowsum(dO * O), both (batch, heads, Lq) fp32;
    ``scales`` fp32 [qkv scale_inv, dO scale_inv, P scale, P scale_inv, dS scale, dS scale_inv];
    P quantized to ``p_dtype``, dS to ``ds_dtype``; ``config`` defaults to DEFAULT_CONFIG."""
    b, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    c = config or DEFAULT_CONFIG
    # dK and dV stored in fp32, then rounded: stored narrower, ptxas spills in this kernel's loop and
    # the backward is slower than the conversion it saves (benchmarks/NOTES.md, attention.py)
    (dq, dk, dv, ds_amax), inputs = prepared(q, qt, k, kt, v, do, dot, lse, delta, torch.float32)
    launch(
        _backward_kernel, (ceil_div(seq_k, c.block_n) * b * heads,),
        *inputs, dq, dk, dv, ds_amax, scales, softmax_scale, seq_q, seq_k, qt.shape[1], kt.shape[1],
        heads // kv_heads, head_dim, causal, c.block_m, c.block_n, c.stagger,
        P_CODE=CODES[p_dtype], DS_CODE=CODES[ds_dtype],
        num_warps=c.num_warps, num_stages=c.num_stages,
    )
    if heads == kv_heads:
        dk, dv = dk.to(grad_dtype), dv.to(grad_dtype)
    return dq, dk, dv, ds_amax.view(torch.float32)
