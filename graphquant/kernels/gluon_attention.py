"""FP8 flash-attention forward for Hopper (sm_90) in Gluon: the Triton forward's numerics
(graphquant.kernels.triton_attention), with the tensor cores' work overlapped with the softmax.

Triton's pipeliner waits for each wgmma where the key loop uses its result, so the Triton kernel
runs QK^T, the softmax and PV one after another. Here the products are issued asynchronously
and waited for explicitly; each iteration of the key loop, for tile j (its logits already taken):

    issue QK^T of tile j+1                       tensor cores
    exponentials of tile j, l, P quantized       meanwhile
    issue PV of tile j (from zero)               tensor cores
    wait for QK^T of tile j+1
    mask, row max and logits of tile j+1         meanwhile
    wait for PV of tile j; O = O * alpha + PV    (the Triton kernel's promotion per key tile)

Every value is the Triton kernel's: the same wgmma instructions (m64nNk32 with N the key tile for
QK^T and the head dim for PV, a warpgroup per 64 query rows, QK^T from zero, PV from zero and
added into O in fp32 once a key tile, one FMA as Triton's compiler contracts it), the same
accumulator layout (so the same order of each row's sum), the same key order in S's columns
(``operand_order``) and the Triton kernel's own helpers for the logits, the exponentials and the
quantization of P. The key tiles that need a mask are masked in the same loop (a branch on the
tile index) rather than a second loop: a tile every row sees whole and its masked twin give the
same bits. The last iteration's QK^T of the tile past the end multiplies zeros (their loads
masked off) and is not used.

Two schedules run that loop (``GluonForwardConfig.warp_specialize``). In the first, the 8 warps of
a program copy the key tiles themselves, STAGES - 2 ahead, and meet at two CTA barriers a tile (one
for the copies, one that Triton's shared-memory analysis adds), so both warpgroups move in step.
Warp-specialized, each warpgroup (64 query rows) is its own partition and a third copies the tiles;
they meet at mbarriers alone (a tile ready, a stage handed back), so one warpgroup's softmax may
run beside the other's products. Either way each row's values are the same. A program is a work
item (a query block of a head: ``_item``), under a causal mask the longest first within a section
of heads (``triton_attention.work_item``; one head by default).

Its configuration is ``GluonForwardConfig``; ``forward`` takes the Triton forward's arguments, and
its bits are those of ``triton_attention.forward`` in ``triton_config(config)``. K and V^T arrive
by cp.async (K's rows permuted in operand order, which TMA cannot copy), 16 bytes a thread, so key
lengths must be multiples of 16.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy, mbarrier, warpgroup_mma, warpgroup_mma_wait

from graphquant.formats import fp8
from graphquant.kernels import triton_attention
from graphquant.kernels.backends import GLUON_LENGTH_MULTIPLE
from graphquant.kernels.triton_launch import ceil_div, launch

NUM_WARPS = gl.constexpr(8)  # two warpgroups, each 64 query rows of the 128: the Triton kernel's default split
COPY_WARPS = gl.constexpr(4)  # warp-specialized, the partition that copies the tiles: one warpgroup


@dataclasses.dataclass(frozen=True)
class GluonForwardConfig:
    """The Gluon forward's schedule: num_stages key tiles of K and V^T in shared memory (cp.async),
    operand_order (S's keys in the PV operand's order, as the Triton kernel's
    ``ForwardConfig.operand_order``), warp_specialize (the tiles copied by a warpgroup of their
    own, each consumer warpgroup a partition: the module's docstring) and the grid's order
    (``triton_attention.work_item``, in sections of heads_a_section heads: one, head by head, as fast
    as any in benchmarks/attention.py's sweep). Tiles are 128 query rows
    over 128 keys, a warpgroup per 64 rows, PV promoted once a key tile: the Triton kernel's
    default."""

    num_stages: int = 4  # 1-4% faster than 5 or 6 at 8k and 16k (benchmarks/NOTES.md, attention.py)
    operand_order: bool = False
    warp_specialize: bool = False
    heads_a_section: int = 1

    def __post_init__(self) -> None:
        # tiles j - 1 to j + 1 in use, j + 2 on its way; 6 stages of K and V^T and Q fill shared memory
        if not 4 <= self.num_stages <= 6:
            raise ValueError(f"Gluon FP8 flash attention: {self!r} is not a configuration: num_stages from 4 to 6")
        if self.heads_a_section < 1:
            raise ValueError(f"Gluon FP8 flash attention: {self!r} is not a configuration: heads_a_section of at least 1")


def launch_warps(config: GluonForwardConfig) -> int:
    """The kernel's warps as launched: warp-specialized, those of its first consumer (the other
    consumer's and the copying warpgroup come on top)."""
    return 4 if config.warp_specialize else NUM_WARPS.value


def default_config(causal: bool) -> GluonForwardConfig:
    """The configuration whose bits are those of the Triton forward's default for this mask,
    warp-specialized: the faster schedule of the two on the H200 (benchmarks/attention.py)."""
    return GluonForwardConfig(operand_order=triton_attention.default_config(causal).operand_order, warp_specialize=True)


def triton_config(config: GluonForwardConfig) -> triton_attention.ForwardConfig:
    """The Triton forward's configuration with the same bits as ``config``."""
    return triton_attention.ForwardConfig(block_m=triton_attention.TILE_ROWS, block_n=triton_attention.TILE_KEYS, num_warps=NUM_WARPS.value,
                                          pv_promotion=fp8.PROMOTED_PRODUCTS, operand_order=config.operand_order)


@gluon.jit
def _load_tile(
    k_slot, vt_slot, k_base, vt_base, vt_stride, start_n, end,
    HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, OPERAND_ORDER: gl.constexpr,
    K_LOAD: gl.constexpr, VT_LOAD: gl.constexpr,
):
    """Copy key tile [start_n, start_n + BLOCK_N) of K (rows in S's column order) and of V^T into
    shared memory (keys from ``end`` on as zeros), as one cp.async group; a tile before ``end``
    without masks (fewer instructions for the copying warps)."""
    if start_n + BLOCK_N <= end:
        _copy_tile(k_slot, vt_slot, k_base, vt_base, vt_stride, start_n, end, HEAD_DIM, BLOCK_N, OPERAND_ORDER, False, K_LOAD, VT_LOAD)
    else:
        _copy_tile(k_slot, vt_slot, k_base, vt_base, vt_stride, start_n, end, HEAD_DIM, BLOCK_N, OPERAND_ORDER, True, K_LOAD, VT_LOAD)
    async_copy.commit_group()


@gluon.jit
def _copy_tile(
    k_slot, vt_slot, k_base, vt_base, vt_stride, start_n, end,
    HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, OPERAND_ORDER: gl.constexpr, MASKED: gl.constexpr,
    K_LOAD: gl.constexpr, VT_LOAD: gl.constexpr,
):
    """``_load_tile``'s cp.async copies (MASKED: keys from ``end`` on as zeros)."""
    keys = start_n + triton_attention.column_keys(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, K_LOAD)), OPERAND_ORDER)
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, K_LOAD))
    offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, VT_LOAD))
    dv = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, VT_LOAD))
    k_rows = k_base + keys[:, None] * HEAD_DIM + d[None, :]
    vt_rows = vt_base + dv[:, None] * vt_stride + offs_n[None, :]
    if MASKED:
        async_copy.async_copy_global_to_shared(k_slot, k_rows, mask=(keys < end)[:, None])
        async_copy.async_copy_global_to_shared(vt_slot, vt_rows, mask=(offs_n < end)[None, :])
    else:
        async_copy.async_copy_global_to_shared(k_slot, k_rows)
        async_copy.async_copy_global_to_shared(vt_slot, vt_rows)


@gluon.jit
def _tile_logits(s, m_i, offs_m, start_n, seq_k, qk_scale, p_shift, masked, CAUSAL: gl.constexpr, OPERAND_ORDER: gl.constexpr):
    """``triton_attention.logits_and_max`` of the key tile from ``start_n``, masked where
    ``masked`` (a tile past the ones every row sees whole), unmasked else (the same bits where no
    key is masked). The keys of S's columns are made where the mask needs them, so that they hold
    no registers across the key loop."""
    if masked:
        keys = start_n + triton_attention.column_keys(gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s.type.layout)), OPERAND_ORDER)
        logits, m_new = triton_attention.logits_and_max(s, m_i, offs_m, keys, seq_k, qk_scale, p_shift, True, CAUSAL)
    else:
        logits, m_new = triton_attention.logits_and_max(s, m_i, offs_m, None, seq_k, qk_scale, p_shift, False, CAUSAL)
    return logits, m_new


@gluon.jit
def _consume(
    q_smem, k_smem, vt_smem, ready, empty, loads, o_base, o_row_stride, LSE, scale_inv, p_shift, qk_scale, bh, row0, seq_q, seq_k,
    full_end, end,
    HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    OPERAND_ORDER: gl.constexpr, WARPS: gl.constexpr, SPECIALIZED: gl.constexpr,
):
    """The key loop and the outputs of query rows [row0, row0 + ROWS) on WARPS warps (a warpgroup
    per 64 rows). SPECIALIZED: the tiles arrive from ``_produce`` (``ready``, a barrier a stage)
    and this partition hands each stage back through ``empty`` once its PV product is done; else
    these warps copy the tiles themselves (``loads``: K's and V^T's bases, V^T's row stride, the
    number of keys to copy), STAGES - 2 tiles ahead, with a CTA barrier a tile."""
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BLOCK_N, 32])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, HEAD_DIM, 32])
    P_OPERAND: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=4)
    ROW: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    K_LOAD: gl.constexpr = copy_layout(HEAD_DIM, WARPS)
    VT_LOAD: gl.constexpr = copy_layout(BLOCK_N, WARPS)
    k_base, vt_base, vt_stride, copy_end = loads
    tiles = gl.cdiv(end, BLOCK_N)

    offs_m = row0 + gl.arange(0, ROWS, layout=ROW)
    zeros_s = gl.zeros([ROWS, BLOCK_N], gl.float32, S_LAYOUT)
    zeros_o = gl.zeros([ROWS, HEAD_DIM], gl.float32, O_LAYOUT)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, ROW)
    l_i = gl.zeros([ROWS], gl.float32, ROW)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, O_LAYOUT)

    # Tile 0's products and logits.
    if SPECIALIZED:
        mbarrier.wait(ready.index(0), 0)
    else:
        async_copy.wait_group(STAGES - 3)
        gl.thread_barrier()
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zeros_s, use_acc=False)
    logits, m_new = _tile_logits(s, m_i, offs_m, 0, seq_k, qk_scale, p_shift, full_end == 0, CAUSAL, OPERAND_ORDER)

    for j in range(tiles):
        if SPECIALIZED:
            mbarrier.wait(ready.index((j + 1) % STAGES), ((j + 1) // STAGES) & 1)
        else:
            # Tile j + 1 in shared memory (the barrier: every thread's copies of it), and tile j +
            # STAGES - 2 on its way into the buffers of tile j - 2, whose PV products every warp
            # waited for before the previous iteration's barrier. Like Triton's pipeline, no proxy
            # fence: the copies are cp.async, which the wgmma reads after the barrier.
            async_copy.wait_group(STAGES - 4)
            ahead = j + STAGES - 2
            _load_tile(k_smem.index(ahead % STAGES), vt_smem.index(ahead % STAGES), k_base, vt_base, vt_stride, ahead * BLOCK_N,
                       copy_end, HEAD_DIM, BLOCK_N, OPERAND_ORDER, K_LOAD, VT_LOAD)
            gl.thread_barrier()
        k_next = k_smem.index((j + 1) % STAGES).permute((1, 0))
        s_next = warpgroup_mma(q_smem, k_next, zeros_s, use_acc=False, is_async=True)

        alpha, l_i, p8 = triton_attention.quantized_p(m_i, m_new, logits, l_i, BLOCK_N, OPERAND_ORDER)
        m_i = m_new
        vt = vt_smem.index(j % STAGES).permute((1, 0))
        pv = warpgroup_mma(gl.convert_layout(p8, P_OPERAND), vt, zeros_o, use_acc=False, is_async=True)

        s_next = warpgroup_mma_wait(1, deps=[s_next])
        start_next = (j + 1) * BLOCK_N
        logits, m_new = _tile_logits(s_next, m_i, offs_m, start_next, seq_k, qk_scale, p_shift, start_next >= full_end, CAUSAL, OPERAND_ORDER)

        pv = warpgroup_mma_wait(0, deps=[pv])
        if SPECIALIZED:
            mbarrier.arrive(empty.index(j % STAGES))
        acc = gl.fma(acc, gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))[:, None], pv)
    if not SPECIALIZED:
        async_copy.wait_group(0)

    o = acc * scale_inv / gl.convert_layout(l_i, gl.SliceLayout(1, O_LAYOUT))[:, None]
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, O_LAYOUT))
    o_rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, O_LAYOUT))
    o_ptrs = o_base + o_rows[:, None] * o_row_stride + offs_d[None, :]
    gl.store(o_ptrs, o.to(o_base.dtype.element_ty), mask=(o_rows < seq_q)[:, None])
    rows = offs_m < seq_q
    gl.store(LSE + bh * seq_q + offs_m, triton_attention.logsumexp(m_i, l_i, p_shift), mask=rows)


@gluon.jit
def _item(w, seq_q, seq_k, section, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Work item w: (its first query row, its (batch, head), ``key_range``'s (full_end, end)), in
    ``triton_attention.work_item``'s order; under a causal mask the query blocks with the most
    key tiles rank first."""
    blocks = gl.cdiv(seq_q, BLOCK_M)
    rank, bh = triton_attention.work_item(w, blocks, section)
    start_m = blocks - 1 - rank if CAUSAL else rank
    full_end, end = triton_attention.key_range(start_m, seq_k, CAUSAL, BLOCK_M, BLOCK_N)
    return start_m * BLOCK_M, bh, full_end, end


@gluon.constexpr_function
def copy_layout(columns, warps):
    """cp.async of 16 bytes a thread, a row of ``columns`` bytes across columns // 16 threads."""
    return gl.BlockedLayout([1, 16], [32 * 16 // columns, columns // 16], [warps, 1], [1, 0])


@gluon.jit
def _copy_q(q_smem, Q, bh, row0, seq_q, HEAD_DIM: gl.constexpr, ROWS: gl.constexpr, WARPS: gl.constexpr):
    """cp.async of Q's rows [row0, row0 + ROWS) (those from seq_q on as zeros)."""
    layout: gl.constexpr = copy_layout(HEAD_DIM, WARPS)
    q_rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    q_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    async_copy.async_copy_global_to_shared(q_smem, Q + (bh * seq_q + q_rows)[:, None] * HEAD_DIM + q_d[None, :], mask=(q_rows < seq_q)[:, None])


@gluon.jit
def _produce(
    q_smem, k_smem, vt_smem, ready, empty, Q, bh, row0, seq_q, k_base, vt_base, vt_stride, end,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, OPERAND_ORDER: gl.constexpr,
):
    """The copying partition (COPY_WARPS warps): Q, then each key tile (one past the last: the
    consumers' last QK^T) into its stage once both consumers handed it back, each tile's arrival on
    ready."""
    _copy_q(q_smem, Q, bh, row0, seq_q, HEAD_DIM, BLOCK_M, COPY_WARPS)
    for t in range(gl.cdiv(end, BLOCK_N) + 1):
        stage = t % STAGES
        mbarrier.wait(empty.index(stage), (t // STAGES + 1) & 1, pred=t >= STAGES)
        _load_tile(k_smem.index(stage), vt_smem.index(stage), k_base, vt_base, vt_stride, t * BLOCK_N, end, HEAD_DIM, BLOCK_N,
                   OPERAND_ORDER, copy_layout(HEAD_DIM, COPY_WARPS), copy_layout(BLOCK_N, COPY_WARPS))
        async_copy.mbarrier_arrive(ready.index(stage), increment_count=False)


@gluon.jit
def _forward_kernel(
    Q, K, VT, O, LSE, SCALE_INV, P_SCALE, softmax_scale, seq_q, seq_k, vt_stride, o_batch_stride, o_head_stride, o_row_stride, section,
    HEADS: gl.constexpr, GROUPS: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, OPERAND_ORDER: gl.constexpr, SPECIALIZED: gl.constexpr,
):
    ROWS_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], gl.float8e4nv)  # Q and K
    VT_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEAD_DIM, BLOCK_N], gl.float8e4nv)

    row0, bh, full_end, end = _item(gl.program_id(0), seq_q, seq_k, section, CAUSAL, BLOCK_M, BLOCK_N)
    kv_bh = triton_attention.kv_head(bh, HEADS, GROUPS)
    k_base = K + kv_bh * seq_k * HEAD_DIM
    vt_base = VT + kv_bh * seq_k
    o_base = O + (bh // HEADS) * o_batch_stride + (bh % HEADS) * o_head_stride
    scale_inv = gl.load(SCALE_INV)
    p_shift = triton_attention.p_exponent(gl.load(P_SCALE))
    qk_scale = triton_attention.logit_scale(scale_inv, softmax_scale)

    q_smem = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_M, HEAD_DIM], ROWS_SMEM)
    k_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, HEAD_DIM], ROWS_SMEM)
    vt_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, HEAD_DIM, BLOCK_N], VT_SMEM)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    loads = (k_base, vt_base, vt_stride, end)
    if SPECIALIZED:  # a warpgroup a partition: 64 query rows each, and the copying one
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=COPY_WARPS * 32)  # every copying thread's copies
            mbarrier.init(empty.index(i), count=2)  # both consumers
        half: gl.constexpr = BLOCK_M // 2
        # Registers a thread, the second consumer's and the copying partition's: the copies need little more than addresses, but
        # at setmaxnreg's least (24) they spill them every tile; 40 keep V^T's, and each consumer has the rest of the SM's 64K over
        # 384 threads (232 + 232 + 40 = 3 * 168), which its loop fits without spills.
        gl.warp_specialize([
            (_consume, (q_smem.slice(0, half), k_smem, vt_smem, ready, empty, loads, o_base, o_row_stride, LSE, scale_inv, p_shift,
                        qk_scale, bh, row0, seq_q, seq_k, full_end, end, HEAD_DIM, CAUSAL, half, BLOCK_N, STAGES, OPERAND_ORDER, 4, True)),
            (_consume, (q_smem.slice(half, half), k_smem, vt_smem, ready, empty, loads, o_base, o_row_stride, LSE, scale_inv, p_shift,
                        qk_scale, bh, row0 + half, seq_q, seq_k, full_end, end, HEAD_DIM, CAUSAL, half, BLOCK_N, STAGES, OPERAND_ORDER, 4, True)),
            (_produce, (q_smem, k_smem, vt_smem, ready, empty, Q, bh, row0, seq_q, k_base, vt_base, vt_stride, end, HEAD_DIM, BLOCK_M,
                        BLOCK_N, STAGES, OPERAND_ORDER)),
        ], [4, COPY_WARPS], [232, 40])
    else:
        _copy_q(q_smem, Q, bh, row0, seq_q, HEAD_DIM, BLOCK_M, NUM_WARPS)
        for i in gl.static_range(STAGES - 2):  # the first tiles (with Q, in the first group)
            _load_tile(k_smem.index(i), vt_smem.index(i), k_base, vt_base, vt_stride, i * BLOCK_N, end, HEAD_DIM, BLOCK_N, OPERAND_ORDER,
                       copy_layout(HEAD_DIM, NUM_WARPS), copy_layout(BLOCK_N, NUM_WARPS))
        _consume(q_smem, k_smem, vt_smem, ready, empty, loads, o_base, o_row_stride, LSE, scale_inv, p_shift, qk_scale, bh, row0, seq_q,
                 seq_k, full_end, end, HEAD_DIM, CAUSAL, BLOCK_M, BLOCK_N, STAGES, OPERAND_ORDER, NUM_WARPS, False)


def forward(q: torch.Tensor, k: torch.Tensor, vt: torch.Tensor, scale_inv: torch.Tensor, p_scale: torch.Tensor, softmax_scale: float,
            causal: bool, out_dtype: torch.dtype, token_major: bool = False, *,
            config: Optional[GluonForwardConfig] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``triton_attention.forward``'s results, bit for bit those of its ``triton_config(config)``
    (``config`` defaults to ``default_config(causal)``, whose bits are the Triton forward's
    default's), on Hopper only, for key lengths that are multiples of 16."""
    b, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    if seq_k % GLUON_LENGTH_MULTIPLE:  # cp.async copies 16 bytes of V^T's rows, which start every seq_k bytes
        raise ValueError(f"Gluon FP8 flash attention takes key lengths that are multiples of {GLUON_LENGTH_MULTIPLE}, not {seq_k}")
    (o, lse), (q, k, vt) = triton_attention.prepared(q, k, vt, out_dtype, token_major)
    config = config or default_config(causal)
    blocks = ceil_div(seq_q, triton_attention.TILE_ROWS)
    launch(
        _forward_kernel, (blocks * b * heads,),
        q, k, vt, o, lse, scale_inv, p_scale, softmax_scale, seq_q, seq_k, vt.shape[1], o.stride(0), o.stride(1), o.stride(2),
        config.heads_a_section, heads, heads // kv_heads, head_dim, causal, triton_attention.TILE_ROWS, triton_attention.TILE_KEYS,
        config.num_stages, config.operand_order, config.warp_specialize,
        num_warps=launch_warps(config),
    )
    return o, lse
