"""FP8 flash-attention forward for Hopper (sm_90): QK^T and PV on the FP8 tensor cores, S never
in memory.

It takes Q, K and V already quantized by graphquant (per-tensor E4M3 codes under their one joint
scale, bit for bit the emulation's, graphquant.ops.attention) and, per (batch, query head) and
block of BLOCK_M query rows, walks the keys BLOCK_N at a time:

    S tile  = Q codes @ K codes^T (fp32)        logits in base 2: S * scale_inv^2 * softmax scale * log2(e)
    online softmax in fp32: running max m, O rescaled by exp2(m_old - m)
    P tile  = exp2(logit - m + log2(p_scale)), unnormalised P times ``p_scale``, cast to E4M3
    running sum l of the P tiles' values
    O      += P codes @ V codes (fp32)

and writes O = acc * scale_inv / l in the output dtype and the natural-log logsumexp of each row's
scaled logits (what a backward recomputes P from). P's scale enters through the exponent, so
that its values need no product before their cast; they are those of P times p_scale within a few
fp32 roundings of the exponent (the tests' bound covers them).

V arrives as its columnwise representation (V^T, keys contiguous: the exact transpose of the
rowwise codes), so the right operand of the PV product is K-major, as Hopper's FP8 wgmma takes it.

The tensor cores sum FP8 products in an accumulator narrower than fp32 (fp8.accumulation_bound
models it). QK^T is one product of head-dim depth from zero, so it sums there whole (fp8.FAST;
promoting at its end changes no bit and costs a second accumulator). PV accumulates into O's fp32 accumulator across the key loop; its partial
sums are promoted into fp32 every ``pv_promotion`` keys (``ForwardConfig``), by default after
every key tile: Triton's default on sm_90 would let the narrow accumulator carry the whole loop.

Tiles, warps, pipeline stages, warp specialization of the key loop, the PV promotion, whether
QK^T runs a tile ahead and the order of the keys in S are a
``ForwardConfig``; ``forward`` uses ``default_config(causal)`` unless told otherwise
(benchmarks/attention_tune.py sweeps them on the GPU).

Causal masks are aligned top left (key j visible to query i where j <= i), as
F.scaled_dot_product_attention's is_causal; lengths that are not multiples of the tiles are
masked; grouped-query attention reads key/value head h // groups for query head h.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from graphquant.formats import fp8
from graphquant.kernels.backends import FLASH_HEAD_DIMS, empty_attention
from graphquant.kernels.triton_launch import ceil_div, launch

# The default tile: 128 query rows a program over 128 keys at a time.
TILE_ROWS = 128
TILE_KEYS = 128


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
    """How the forward kernel tiles and schedules its work: block_m query rows per program over
    block_n keys at a time, num_warps warps, num_stages pipeline stages of the key loop,
    warp_specialize (Triton's automatic warp specialization of the key loop), and pv_promotion:
    how many keys the tensor cores may sum in their narrow accumulator before the PV partial sum
    is added into fp32 (a multiple of 32 up to block_n and fp8.PROMOTED_PRODUCTS, 128, the depth
    the error bound of tests/test_triton_attention.py covers; None: never, the narrow accumulator
    carries the whole key loop, outside that bound); qk_ahead: in the key tiles every query row sees whole,
    the next tile's QK^T issued before this tile's exponentials, so that the tensor cores may
    compute it meanwhile (the same bits);
    operand_order: K's rows loaded in the order that lets P reach the PV product's register operand
    without an exchange between threads (``column_keys``; P's values the same, l summed in
    another order)."""

    block_m: int = TILE_ROWS
    block_n: int = TILE_KEYS
    num_warps: int = 8
    num_stages: int = 3
    warp_specialize: bool = False
    pv_promotion: Optional[int] = fp8.PROMOTED_PRODUCTS
    qk_ahead: bool = False
    operand_order: bool = False

    def __post_init__(self) -> None:
        rows, keys = (16, 32, 64, 128, 256), (32, 64, 128, 256)  # keys are PV's depth: an FP8 wgmma is 32 deep
        promotion_ok = self.pv_promotion is None or (self.pv_promotion % 32 == 0 and 0 < self.pv_promotion <= min(self.block_n, fp8.PROMOTED_PRODUCTS))
        if self.block_m not in rows or self.block_n not in keys or self.num_warps not in (4, 8, 16) or self.num_stages < 1 or not promotion_ok:
            raise ValueError(
                f"FP8 flash attention: {self!r} is not a configuration: block_m one of {rows}, block_n one of {keys}, "
                f"num_warps 4, 8 or 16, num_stages at least 1, pv_promotion None or a multiple of 32 up to block_n and {fp8.PROMOTED_PRODUCTS}"
            )


# The defaults are the H200's best of benchmarks/attention_tune.py's sweeps at head dim 128
# (NOTES.md): 128 query rows over two warpgroups, 128-key tiles, three stages, PV promoted per tile,
# S's keys in the PV operand's order; without a mask also QK^T a tile ahead, which under a causal
# mask was slower. Under a causal mask the operand order is the bits of the Gluon forward's fastest
# schedule (graphquant.kernels.gluon_attention, which the plan runs there), for about 1% of this
# kernel's speed.
DEFAULT_CONFIG = ForwardConfig(qk_ahead=True, operand_order=True)
CAUSAL_DEFAULT_CONFIG = ForwardConfig(operand_order=True)


def default_config(causal: bool) -> ForwardConfig:
    """The configuration ``forward`` runs when given none."""
    return CAUSAL_DEFAULT_CONFIG if causal else DEFAULT_CONFIG


@triton.jit
def column_keys(c, OPERAND_ORDER: tl.constexpr):
    """The key (within its tile) whose products each column ``c`` of S holds. In operand order, column
    b + 2a + 8i + 32j (b < 2, a < 4, i < 4) holds key b + 2(i % 2) + 4a + 16(i // 2) + 32j: the
    thread of the tensor cores' accumulator that holds columns 2a + b + 8i of each 32 then holds
    the 8 keys 4a..4a+3 and 16+4a..16+4a+3 that the PV product's register operand asks of it, so
    P reaches that operand without an exchange between threads (``_in_key_order``)."""
    if OPERAND_ORDER:
        return (c & 1) + ((c >> 3) & 1) * 2 + ((c >> 1) & 3) * 4 + (c >> 4) * 16
    return c


@triton.jit
def _in_key_order(p, BLOCK_N: tl.constexpr):
    """P's columns from operand order (``column_keys``) back to key order: a relabelling of the
    values each thread holds."""
    rows: tl.constexpr = p.shape[0]
    by_bits = tl.reshape(p, [rows, BLOCK_N // 32, 2, 2, 4, 2])  # column = b + 2a + 8(i % 2) + 16(i // 2) + 32j
    return tl.reshape(tl.permute(by_bits, [0, 1, 2, 4, 3, 5]), [rows, BLOCK_N])


@triton.jit
def _scores(q, k_base, keys, offs_d, limit, MASKED: tl.constexpr):
    """Q codes @ K codes^T over ``keys`` (those from ``limit`` on read as zeros when MASKED)."""
    rows = k_base + keys[:, None] * offs_d.shape[0] + offs_d[None, :]
    if MASKED:
        k = tl.load(rows, mask=(keys < limit)[:, None], other=0.0)
    else:
        k = tl.load(rows)
    return tl.dot(q, tl.trans(k))


@triton.jit
def logits_and_max(s, m_i, offs_m, keys, seq_k, qk_scale, p_shift, MASKED: tl.constexpr, CAUSAL: tl.constexpr):
    """The base-2 logits of one key tile's products ``s`` (Q codes @ K codes^T, column c holding
    key keys[c]) less the new running max and plus ``p_shift`` (``p_exponent``), and that max."""
    if MASKED:
        visible = keys[None, :] < seq_k
        if CAUSAL:
            visible = visible & (keys[None, :] <= offs_m[:, None])
        s = tl.where(visible, s, float("-inf"))
    # The max of the raw products, scaled, is the max of the scaled logits bit for bit (rounding a
    # product by a positive factor is monotonic); each logit is then scaled and shifted in one FMA.
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    return s * qk_scale - (m_new - p_shift)[:, None], m_new


@triton.jit
def p_exponent(p_scale):
    """log2 of P's scale, which the logits take on before their exponentials so that these are
    P's scaled values, ready for the cast: one subtraction a row in place of a product a value."""
    return tl.math.log2(p_scale)


@triton.jit
def quantized_p(m_i, m_new, logits, l_i, BLOCK_N: tl.constexpr, OPERAND_ORDER: tl.constexpr):
    """From one key tile's ``logits_and_max``: O's rescaling factor alpha, the new running sum l
    (of P's scaled values) and the tile's P codes (keys in order), the operand of its PV product."""
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(logits)
    l_i = l_i * alpha + tl.sum(p, 1)
    p8 = p.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    if OPERAND_ORDER:
        p8 = _in_key_order(p8, BLOCK_N)
    return alpha, l_i, p8


@triton.jit
def _fold(
    acc, l_i, m_i, m_new, logits, vt,
    BLOCK_N: tl.constexpr, PV_PROMOTION: tl.constexpr, OPERAND_ORDER: tl.constexpr,
):
    """Fold one key tile's ``logits_and_max`` and V^T codes (keys in order) into the running (acc,
    l, m)."""
    alpha, l_i, p8 = quantized_p(m_i, m_new, logits, l_i, BLOCK_N, OPERAND_ORDER)
    if PV_PROMOTION is None:  # the narrow accumulator carries O across the key loop
        acc = tl.dot(p8, tl.trans(vt), acc * alpha[:, None])
    else:  # the tile's product from zero (promoted every PV_PROMOTION keys within it), added in fp32
        promotion: tl.constexpr = PV_PROMOTION if PV_PROMOTION < BLOCK_N else None
        acc = acc * alpha[:, None] + tl.dot(p8, tl.trans(vt), max_num_imprecise_acc=promotion)
    return acc, l_i, m_new


@triton.jit
def _key_tiles(
    acc, l_i, m_i, q, k_base, vt_base, vt_stride, offs_m, start, end, seq_k, qk_scale, p_shift,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    PV_PROMOTION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, QK_AHEAD: tl.constexpr,
    OPERAND_ORDER: tl.constexpr,
):
    """Fold the key tiles [start, end) into the running (acc, l, m); MASKED: some keys of these
    tiles are past seq_k or (CAUSAL) after a query row. QK_AHEAD: each tile's QK^T is issued
    between the previous tile's logits and its exponentials, so the tensor cores may compute it
    meanwhile, into the registers the previous products have just left (one product of zeros
    past the last tile)."""
    offs_d = tl.arange(0, HEAD_DIM)
    columns = column_keys(tl.arange(0, BLOCK_N), OPERAND_ORDER)
    if QK_AHEAD:
        s = _scores(q, k_base, start + columns, offs_d, end, True)
    for start_n in tl.range(start, end, BLOCK_N, warp_specialize=WARP_SPECIALIZE and not MASKED):
        keys = start_n + columns
        if not QK_AHEAD:
            s = _scores(q, k_base, keys, offs_d, seq_k, MASKED)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if MASKED:
            vt = tl.load(vt_base + offs_d[:, None] * vt_stride + offs_n[None, :], mask=offs_n[None, :] < seq_k, other=0.0)
        else:
            vt = tl.load(vt_base + offs_d[:, None] * vt_stride + offs_n[None, :])
        logits, m_new = logits_and_max(s, m_i, offs_m, keys, seq_k, qk_scale, p_shift, MASKED, CAUSAL)
        if QK_AHEAD:
            s = _scores(q, k_base, keys + BLOCK_N, offs_d, end, True)
        acc, l_i, m_i = _fold(acc, l_i, m_i, m_new, logits, vt, BLOCK_N, PV_PROMOTION, OPERAND_ORDER)
    return acc, l_i, m_i


@triton.jit
def logsumexp(m_i, l_i, p_shift):
    """Each row's natural-log logsumexp of its scaled logits, from the running max and the sum of
    P's scaled values."""
    return (m_i + tl.math.log2(l_i) - p_shift) * 0.6931471805599453  # ln(2): back to natural-log units


@triton.jit
def kv_head(bh, HEADS: tl.constexpr, GROUPS: tl.constexpr):
    """The key/value (batch, head) row of query (batch, head) ``bh``: head h // GROUPS of its batch."""
    return (bh // HEADS) * (HEADS // GROUPS) + (bh % HEADS) // GROUPS


@triton.jit
def logit_scale(codes_scale_inv, softmax_scale):
    """What turns a product of Q's and K's codes into log2-domain logits: both dequantizing
    factors, the softmax scale and log2(e) (exp2 in place of exp)."""
    return codes_scale_inv * codes_scale_inv * softmax_scale * 1.4426950408889634


@triton.jit
def work_item(w, blocks, section):
    """Work item ``w`` of a one-dimensional grid of (batch, head) x ``blocks``: (its block's rank,
    its (batch, head)). The heads go in sections of ``section``, and a section's programs take
    rank 0 of each of its heads, then rank 1, and so on; with sections of one head (the Gluon
    kernels' default), a head's blocks one after another. A kernel whose blocks differ in length
    (a causal mask) ranks the longest first, so that the grid ends on the shortest blocks of its
    last section rather than on a head's longest block started near the end."""
    per_section = section * blocks
    first = w // per_section * section
    within = w % per_section
    heads_here = tl.minimum(section, tl.num_programs(0) // blocks - first)
    return within // heads_here, (first + within % heads_here).to(tl.int64)


@triton.jit
def key_range(start_m, seq_k, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(full_end, end) for query block ``start_m``: its rows see the keys [0, full_end) whole
    (whole key tiles) and need a mask in [full_end, end)."""
    full_end = (seq_k // BLOCK_N) * BLOCK_N
    end = seq_k
    if CAUSAL:
        diagonal_start = ((start_m * BLOCK_M + 1) // BLOCK_N) * BLOCK_N
        if diagonal_start < full_end:
            full_end = diagonal_start
        if (start_m + 1) * BLOCK_M < seq_k:
            end = (start_m + 1) * BLOCK_M
    return full_end, end


@triton.jit
def _forward_kernel(
    Q, K, VT, O, LSE, SCALE_INV, P_SCALE, softmax_scale, seq_q, seq_k, vt_stride, o_batch_stride, o_head_stride, o_row_stride,
    HEADS: tl.constexpr, GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PV_PROMOTION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    QK_AHEAD: tl.constexpr, OPERAND_ORDER: tl.constexpr,
):
    start_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    kv_bh = kv_head(bh, HEADS, GROUPS)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_m < seq_q
    q = tl.load(Q + (bh * seq_q + offs_m)[:, None] * HEAD_DIM + offs_d[None, :], mask=rows[:, None], other=0.0)
    k_base = K + kv_bh * seq_k * HEAD_DIM
    vt_base = VT + kv_bh * seq_k
    scale_inv = tl.load(SCALE_INV)
    p_shift = p_exponent(tl.load(P_SCALE))
    qk_scale = logit_scale(scale_inv, softmax_scale)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Tiles every row of the block sees whole, then the ones that need a mask (one or two a program:
    # QK^T a tile ahead there would only add its product of zeros).
    full_end, end = key_range(start_m, seq_k, CAUSAL, BLOCK_M, BLOCK_N)
    acc, l_i, m_i = _key_tiles(
        acc, l_i, m_i, q, k_base, vt_base, vt_stride, offs_m, 0, full_end, seq_k, qk_scale, p_shift,
        HEAD_DIM, BLOCK_N, False, CAUSAL, PV_PROMOTION, WARP_SPECIALIZE, QK_AHEAD, OPERAND_ORDER,
    )
    acc, l_i, m_i = _key_tiles(
        acc, l_i, m_i, q, k_base, vt_base, vt_stride, offs_m, full_end, end, seq_k, qk_scale, p_shift,
        HEAD_DIM, BLOCK_N, True, CAUSAL, PV_PROMOTION, WARP_SPECIALIZE, False, OPERAND_ORDER,
    )

    o = acc * scale_inv / l_i[:, None]
    o_base = O + (bh // HEADS) * o_batch_stride + (bh % HEADS) * o_head_stride
    tl.store(o_base + offs_m[:, None] * o_row_stride + offs_d[None, :], o.to(O.dtype.element_ty), mask=rows[:, None])
    lse = logsumexp(m_i, l_i, p_shift)
    tl.store(LSE + bh * seq_q + offs_m, lse, mask=rows)


def prepared(q: torch.Tensor, k: torch.Tensor, vt: torch.Tensor, out_dtype: torch.dtype, token_major: bool) -> tuple[tuple, tuple]:
    """The outputs a forward fills (O, logsumexp: see ``forward``) and the codes
    contiguous; refuses codes it does not take."""
    b, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    if head_dim not in FLASH_HEAD_DIMS or k.shape[3] != head_dim or vt.shape != (head_dim, b * kv_heads * seq_k):
        raise ValueError(
            f"FP8 flash attention takes head dims {FLASH_HEAD_DIMS}, one for Q, K and V, and V^T of shape "
            f"(D, batch * kv heads * Lk); got q {tuple(q.shape)}, k {tuple(k.shape)}, vt {tuple(vt.shape)}"
        )
    if heads % kv_heads or seq_k == 0:
        raise ValueError(f"FP8 flash attention: {heads} query heads over {kv_heads} key/value heads of {seq_k} keys")
    o = empty_attention(q.shape, out_dtype, q.device, token_major)
    lse = torch.empty((b, heads, seq_q), device=q.device, dtype=torch.float32)
    return (o, lse), (q.contiguous(), k.contiguous(), vt.contiguous())


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    vt: torch.Tensor,
    scale_inv: torch.Tensor,
    p_scale: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    out_dtype: torch.dtype,
    token_major: bool = False,
    *,
    config: Optional[ForwardConfig] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(O (batch, heads, Lq, D) in out_dtype, token by token in memory where ``token_major`` says
    (``backends.empty_attention``), logsumexp (batch, heads, Lq) fp32) of E4M3 codes q (batch, heads, Lq, D), k
    (batch, kv heads, Lk, D) and vt (D, batch * kv heads * Lk), all three under the one ``scale_inv``, P tiles quantized with
    ``p_scale`` (both one float32 on the device); ``config`` defaults to ``default_config(causal)``."""
    b, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    (o, lse), (q, k, vt) = prepared(q, k, vt, out_dtype, token_major)
    config = config or default_config(causal)
    launch(
        _forward_kernel, (ceil_div(seq_q, config.block_m), b * heads),
        q, k, vt, o, lse, scale_inv, p_scale, softmax_scale,
        seq_q, seq_k, vt.shape[1], o.stride(0), o.stride(1), o.stride(2), heads, heads // kv_heads, head_dim, causal,
        config.block_m, config.block_n, config.pv_promotion, config.warp_specialize, config.qk_ahead,
        config.operand_order, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return o, lse

