"""FP8 flash-attention backward for Hopper (sm_90) in Gluon: the Triton backward's numerics
(graphquant.kernels.triton_attention_backward), with its products issued asynchronously.

Triton waits for each wgmma whose operand is in registers, so its backward runs its five products
one after another. Here a program (a key tile of BLOCK_N keys of one (batch, query head), two
warpgroups of 64 keys each) walks the query tiles BLOCK_M rows at a time, and for each tile:

    issue S^T = K @ Q^T and dP^T = V @ dO^T           tensor cores
    wait for S^T; P^T                                  meanwhile dP^T
    wait for dP^T; dS^T and its largest |dS|; P^T, dS^T and dS (keys contiguous) quantized into
    shared memory, the A operands of the next products
    issue dQ = dS @ K and dV's first half (P^T @ dO); wait for dQ, store it into shared memory
    (once the previous tile's reduction has read it) and add it into DQ by TMA reduction; then dV's second half and dK's halves (dS^T @ Q), each
    wait leaving one product in flight and adding the one it waited for into its fp32 accumulator

Every value is the Triton backward's in its default configuration (``triton_config``): each
product from zero over the same depth in the same order (S^T and dP^T over the head dim, dV and
dK over the BLOCK_M rows, dQ over the BLOCK_N keys) and added in fp32 as Triton adds it, the
query tiles walked in the same order, the elementwise steps the Triton kernel's own helpers. dK
and dV are kept in halves of the head dim (a product's columns are independent sums: the same
bits) so that two products' partial sums fit in the registers beside them. The query tiles every
row of which sees every key run in a loop of their own without masks (most tiles: under a causal
mask all but those on the diagonal; fewer instructions than the masked loop's, whose comparisons
and selections were a sixth of the causal loop's), the others masked (where Triton's is not, every
row sees every key: the same bits). dQ's tiles, as Triton's atomic
adds, meet in DQ in no fixed order: two key tiles' sums are the same bits either way, more may
differ in dQ's last bits (tests/test_gluon_attention_backward.py). A TMA reduction adds a tile in
whole lines: a thread's atomic adds of the same tile, one 32-byte sector a request, were a quarter
of the backward's time and held L2 busy (benchmarks/NOTES.md).

The program is warp-specialized: a warpgroup of its own copies the keys and then each query
tile's Q, Q^T, dO, dO^T, logsumexp and D by cp.async into one of STAGES stages, each tile's arrival
on an mbarrier, and the products' 8 warps hand a stage back through another once every warp is
done with its tile. Copying the tiles themselves, the products' warps stalled behind their copies
and met at one more CTA barrier a tile: the copying partition made the backward 1.05-1.17x faster
(benchmarks/NOTES.md). Q^T, dO^T and K^T arrive 16 bytes a thread, so query and key lengths must be
multiples of 16 (GLUON_LENGTH_MULTIPLE).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from triton._C.libtriton import gluon_ir, ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import async_copy, fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from graphquant.kernels import triton_attention, triton_attention_backward
from graphquant.kernels.backends import GLUON_LENGTH_MULTIPLE
from graphquant.kernels.gluon_attention import copy_layout
from graphquant.kernels.triton_launch import ceil_div, launch
from graphquant.kernels.triton_scales import fp8_codes

if not (hasattr(gluon_ir.GluonOpBuilder, "create_async_tma_reduce") and hasattr(ir, "DESCRIPTOR_REDUCE_KIND")):
    raise ImportError("the Gluon FP8 flash backward adds dQ's tiles by TMA reductions, which this Triton's Gluon cannot build")

NUM_WARPS = gl.constexpr(8)  # two warpgroups, 64 keys each of the program's 128
BLOCK_M = gl.constexpr(64)  # query rows a tile: the Triton backward's default
BLOCK_N = gl.constexpr(128)  # keys a program: the Triton backward's default
COPY_WARPS = gl.constexpr(4)  # the partition that copies the tiles: one warpgroup
# Its registers a thread, setmaxnreg's least: the products' warps get 240. With 40 (the products at 232) their loops
# under a causal mask spilled and ran 0.84x (benchmarks/NOTES.md).
COPY_REGISTERS = gl.constexpr(24)


@dataclasses.dataclass(frozen=True)
class GluonBackwardConfig:
    """The Gluon backward's schedule: num_stages query tiles (Q, Q^T, dO, dO^T) in shared memory,
    and the grid's order (``triton_attention.work_item``, in sections of heads_a_section heads: one,
    head by head, as fast as any in benchmarks/attention.py's sweep)."""

    num_stages: int = 2  # 1-2.5% faster than 3 at 8k and 16k (benchmarks/NOTES.md, attention_ab.py)
    heads_a_section: int = 1

    def __post_init__(self) -> None:
        # K, V, K^T, P^T, dS and dQ's tile stay in shared memory beside the stages: 4 stages of 32 KB overfill it at head dim 128
        if self.num_stages not in (2, 3):
            raise ValueError(f"Gluon FP8 flash attention backward: {self!r} is not a configuration: num_stages 2 or 3")
        if self.heads_a_section < 1:
            raise ValueError(f"Gluon FP8 flash attention backward: {self!r} is not a configuration: heads_a_section of at least 1")


DEFAULT_CONFIG = GluonBackwardConfig()


def triton_config() -> triton_attention_backward.BackwardConfig:
    """The Triton backward's configuration whose bits the Gluon backward's are."""
    return triton_attention_backward.BackwardConfig(block_m=BLOCK_M.value, block_n=BLOCK_N.value, num_warps=NUM_WARPS.value)


@builtin
def _reduce_add(tensor_desc, coord, src, _semantic=None):
    """Add shared memory ``src`` into ``tensor_desc``'s block at ``coord`` by one TMA reduction
    (cp.reduce.async.bulk.tensor .add): Triton 3.6 builds it, Gluon does not name it yet."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.constexpr_function
def _accumulator_layout(columns, warps_down):
    """A wgmma accumulator's layout over NUM_WARPS warps, ``warps_down`` of them down its rows, the
    rest across, each product ``columns`` wide."""
    warps = [warps_down, NUM_WARPS.value // warps_down]
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps, instr_shape=[16, columns, 32])


@gluon.jit
def _load_query_tile(
    stages, slot, q_base, qt_base, do_base, dot_base, lse_base, delta_base, start_m, seq_q, qt_stride,
    HEAD_DIM: gl.constexpr,
):
    """Copy query rows [start_m, start_m + BLOCK_M) of Q and dO, their columns of Q^T and dO^T
    and their logsumexp and D (rows from seq_q on as zeros; the bases those of the program's
    (batch, head)) into slot ``slot`` of each of ``stages``, as one cp.async group of the copying warps."""
    ROWS_LOAD: gl.constexpr = copy_layout(HEAD_DIM, COPY_WARPS)
    COLUMNS_LOAD: gl.constexpr = copy_layout(BLOCK_M, COPY_WARPS)
    VECTOR_LOAD: gl.constexpr = gl.BlockedLayout([4], [32], [COPY_WARPS], [0])  # 16 bytes a thread (most copy the same)
    q_slot, qt_slot, do_slot, dot_slot = stages[0].index(slot), stages[1].index(slot), stages[2].index(slot), stages[3].index(slot)
    lse_slot, delta_slot = stages[4].index(slot), stages[5].index(slot)
    rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ROWS_LOAD))
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ROWS_LOAD))
    offsets = rows[:, None] * HEAD_DIM + d[None, :]
    async_copy.async_copy_global_to_shared(q_slot, q_base + offsets, mask=(rows < seq_q)[:, None])
    async_copy.async_copy_global_to_shared(do_slot, do_base + offsets, mask=(rows < seq_q)[:, None])
    columns = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, COLUMNS_LOAD))
    dt = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, COLUMNS_LOAD))
    offsets_t = dt[:, None] * qt_stride + columns[None, :]
    async_copy.async_copy_global_to_shared(qt_slot, qt_base + offsets_t, mask=(columns < seq_q)[None, :])
    async_copy.async_copy_global_to_shared(dot_slot, dot_base + offsets_t, mask=(columns < seq_q)[None, :])
    vector = start_m + gl.arange(0, BLOCK_M, layout=VECTOR_LOAD)
    async_copy.async_copy_global_to_shared(lse_slot, lse_base + vector, mask=vector < seq_q)
    async_copy.async_copy_global_to_shared(delta_slot, delta_base + vector, mask=vector < seq_q)
    async_copy.commit_group()


@gluon.jit
def _load_key_tile(k_smem, v_smem, kt_smem, K, V, KT, kv_first, start_n, seq_k, kt_stride, HEAD_DIM: gl.constexpr):
    """Copy the program's keys of K, V and K^T (keys from seq_k on as zeros), as one cp.async group
    of the copying warps."""
    ROWS_LOAD: gl.constexpr = copy_layout(HEAD_DIM, COPY_WARPS)
    COLUMNS_LOAD: gl.constexpr = copy_layout(BLOCK_N, COPY_WARPS)
    keys = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ROWS_LOAD))
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ROWS_LOAD))
    offsets = (kv_first + keys)[:, None] * HEAD_DIM + d[None, :]
    async_copy.async_copy_global_to_shared(k_smem, K + offsets, mask=(keys < seq_k)[:, None])
    async_copy.async_copy_global_to_shared(v_smem, V + offsets, mask=(keys < seq_k)[:, None])
    columns = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, COLUMNS_LOAD))
    dt = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, COLUMNS_LOAD))
    async_copy.async_copy_global_to_shared(kt_smem, KT + dt[:, None] * kt_stride + (kv_first + columns)[None, :], mask=(columns < seq_k)[None, :])
    async_copy.commit_group()


@gluon.jit
def _masked(pt, offs_n, offs_m, seq_k, CAUSAL_MASK: gl.constexpr, KEY_MASK: gl.constexpr):
    """P^T with 0 where (KEY_MASK) a key is past seq_k or (CAUSAL_MASK) after the row: the Triton
    kernel's mask, one comparison a value, or none where no key of the tile can be masked."""
    if CAUSAL_MASK and KEY_MASK:
        pt = gl.where(offs_n[:, None] <= gl.minimum(offs_m, seq_k - 1)[None, :], pt, 0.0)
    elif CAUSAL_MASK:
        pt = gl.where(offs_n[:, None] <= offs_m[None, :], pt, 0.0)
    elif KEY_MASK:
        pt = gl.where((offs_n < seq_k)[:, None], pt, 0.0)
    return pt


@gluon.jit
def _store_half(X, out, x, factor, keys, GROUPS: gl.constexpr):
    """One half of dK or dV, scaled: stored in the gradient's dtype (the fp32 value rounded once,
    as Triton's backward rounds it), or (grouped) added into its key/value head's fp32 sum."""
    if GROUPS == 1:
        gl.store(X + out, (x * factor).to(X.dtype.element_ty), mask=keys[:, None])
    else:
        gl.atomic_add(X + out, x * factor, mask=keys[:, None], sem="relaxed")


@gluon.jit
def _query_tile(
    j, state, stages, buffers, offs_n, lo, seq_q, seq_k, bh, scales, ready, empty,
    HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, P_CODE: gl.constexpr, DS_CODE: gl.constexpr,
    CAUSAL_MASK: gl.constexpr, KEY_MASK: gl.constexpr, ROW_MASK: gl.constexpr,
):
    """Query tile j's products and their sums into ``state`` (dV's and dK's halves, each key's
    largest |dS| so far): the module's docstring, step by step. Masked where this tile may have
    keys after a row (CAUSAL_MASK), keys past seq_k (KEY_MASK) or rows past seq_q (ROW_MASK). The
    tile arrives from ``_produce`` (``ready``, a barrier a stage); the stage of tile j - 1 goes
    back through ``empty``."""
    HALF: gl.constexpr = HEAD_DIM // 2
    S_LAYOUT: gl.constexpr = _accumulator_layout(BLOCK_M, NUM_WARPS)
    KV_LAYOUT: gl.constexpr = _accumulator_layout(HALF, NUM_WARPS)
    DQ_LAYOUT: gl.constexpr = _accumulator_layout(HALF, NUM_WARPS // 2)
    ROWS: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)
    dv0, dv1, dk0, dk1, ds_amax = state
    q_smem, qt_smem, do_smem, dot_smem, lse_smem, delta_smem = stages
    k_smem, v_smem, kt, pt_smem, dst_smem, ds_smem, dq_smem, dq_tiles = buffers
    qk_scale, dp_factor, grad_factor, s_scale, dp_scale = scales
    zeros_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, S_LAYOUT)
    zeros_kv = gl.zeros([BLOCK_N, HALF], gl.float32, KV_LAYOUT)
    zeros_dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, DQ_LAYOUT)
    dq_tile = dq_smem.reshape([BLOCK_M, HEAD_DIM])
    stage = j % STAGES
    mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
    start_m = lo + j * BLOCK_M
    st = warpgroup_mma(k_smem, q_smem.index(stage).permute((1, 0)), zeros_s, use_acc=False, is_async=True)
    dpt = warpgroup_mma(v_smem, do_smem.index(stage).permute((1, 0)), zeros_s, use_acc=False, is_async=True)

    st = warpgroup_mma_wait(1, deps=[st])
    offs_m = start_m + gl.arange(0, BLOCK_M, layout=ROWS)
    lse = lse_smem.index(stage).load(ROWS)
    if ROW_MASK:
        lse = gl.where(offs_m < seq_q, lse, float("inf"))
    pt = triton_attention_backward.transposed_p(st, lse * 1.4426950408889634, qk_scale)  # log2(e)
    pt = _masked(pt, offs_n, offs_m, seq_k, CAUSAL_MASK, KEY_MASK)
    dpt = warpgroup_mma_wait(0, deps=[dpt])
    dst = triton_attention_backward.transposed_ds(pt, dpt, delta_smem.index(stage).load(ROWS), dp_factor)
    ds_amax = triton_attention_backward.abs_max(ds_amax, dst)
    # P^T and dS^T as the A operands of dV and dK, dS (keys contiguous) as dQ's, in shared memory,
    # once every warp is done with tile j - 1's products, which read them (the barrier; that tile's
    # stage then goes back to the copying warps).
    gl.thread_barrier()
    mbarrier.arrive(empty.index((j + STAGES - 1) % STAGES), pred=j > 0)
    pt_smem.store(fp8_codes(pt, s_scale, P_CODE))
    ds8 = fp8_codes(dst, dp_scale, DS_CODE)
    dst_smem.store(ds8)
    ds_smem.store(gl.permute(ds8, (1, 0)))
    fence_async_shared()
    # The previous dQ tile's reduction done reading shared memory before any warp writes this one:
    # waited for at the top of the tile instead, it stalled every warp there (benchmarks/NOTES.md).
    tma.store_wait(0)
    gl.thread_barrier()

    dot = dot_smem.index(stage)
    qt = qt_smem.index(stage)
    dq = warpgroup_mma(ds_smem, kt, zeros_dq, use_acc=False, is_async=True)
    dv0_tile = warpgroup_mma(pt_smem, dot.slice(0, HALF).permute((1, 0)), zeros_kv, use_acc=False, is_async=True)
    dq = warpgroup_mma_wait(1, deps=[dq])
    # Issued here, after a barrier of its own: issued after the next tile's first barrier instead,
    # it was 4-7% slower without a mask (benchmarks/NOTES.md).
    dq_tile.store(dq * grad_factor)
    fence_async_shared()
    gl.thread_barrier()
    _reduce_add(dq_tiles, [bh.to(gl.int32), start_m, 0], dq_smem)  # one thread issues it; rows from seq_q on fall outside
    dv1_tile = warpgroup_mma(pt_smem, dot.slice(HALF, HALF).permute((1, 0)), zeros_kv, use_acc=False, is_async=True)
    dv0_tile = warpgroup_mma_wait(1, deps=[dv0_tile])
    dv0 = dv0 + dv0_tile
    dk0_tile = warpgroup_mma(dst_smem, qt.slice(0, HALF).permute((1, 0)), zeros_kv, use_acc=False, is_async=True)
    dv1_tile = warpgroup_mma_wait(1, deps=[dv1_tile])
    dv1 = dv1 + dv1_tile
    dk1_tile = warpgroup_mma(dst_smem, qt.slice(HALF, HALF).permute((1, 0)), zeros_kv, use_acc=False, is_async=True)
    dk0_tile = warpgroup_mma_wait(1, deps=[dk0_tile])
    dk0 = dk0 + dk0_tile
    dk1_tile = warpgroup_mma_wait(0, deps=[dk1_tile])
    dk1 = dk1 + dk1_tile
    return dv0, dv1, dk0, dk1, ds_amax


@gluon.jit
def _backward_kernel(
    Q, QT, K, KT, V, DO, DOT, LSE, DELTA, DQ_TILES, DK, DV, DS_AMAX_BITS, SCALES, softmax_scale, seq_q, seq_k, qt_stride, kt_stride, section,
    GROUPS: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
    P_CODE: gl.constexpr, DS_CODE: gl.constexpr, KEY_MASK: gl.constexpr, ROW_MASK: gl.constexpr,
):
    # A one-dimensional grid in work_item's order: under a causal mask the first key tiles, which
    # the most query tiles see, rank first.
    tiles = gl.cdiv(seq_k, BLOCK_N)
    tile, bh = triton_attention.work_item(gl.program_id(0), tiles, section)  # bh: (batch, query head)
    kv_bh = bh // GROUPS
    start_n = tile * BLOCK_N
    first = bh * seq_q
    kv_first = kv_bh * seq_k

    qkv_inv, do_inv = gl.load(SCALES), gl.load(SCALES + 1)
    s_scale, dp_scale, dp_inv = gl.load(SCALES + 2), gl.load(SCALES + 4), gl.load(SCALES + 5)
    qk_scale = triton_attention.logit_scale(qkv_inv, softmax_scale)
    dp_factor = do_inv * qkv_inv
    grad_factor = dp_inv * qkv_inv * softmax_scale

    # The Triton kernel's walk: from the first tile with a row that sees a key (under a causal mask).
    lo = 0
    if CAUSAL:
        lo = (start_n // BLOCK_M) * BLOCK_M
    steps = gl.cdiv(gl.maximum(seq_q - lo, 0), BLOCK_M)

    ROWS_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], gl.float8e4nv)
    COLUMNS_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEAD_DIM, BLOCK_M], gl.float8e4nv)
    KEYS_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], gl.float8e4nv)
    KT_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEAD_DIM, BLOCK_N], gl.float8e4nv)
    DS_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.float8e4nv)
    k_smem = gl.allocate_shared_memory(K.dtype.element_ty, [BLOCK_N, HEAD_DIM], KEYS_SMEM)
    v_smem = gl.allocate_shared_memory(V.dtype.element_ty, [BLOCK_N, HEAD_DIM], KEYS_SMEM)
    kt_smem = gl.allocate_shared_memory(KT.dtype.element_ty, [HEAD_DIM, BLOCK_N], KT_SMEM)
    q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [STAGES, BLOCK_M, HEAD_DIM], ROWS_SMEM)
    do_smem = gl.allocate_shared_memory(DO.dtype.element_ty, [STAGES, BLOCK_M, HEAD_DIM], ROWS_SMEM)
    qt_smem = gl.allocate_shared_memory(QT.dtype.element_ty, [STAGES, HEAD_DIM, BLOCK_M], COLUMNS_SMEM)
    dot_smem = gl.allocate_shared_memory(DOT.dtype.element_ty, [STAGES, HEAD_DIM, BLOCK_M], COLUMNS_SMEM)
    TRANSPOSED_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], gl.float8e4nv)
    pt_smem = gl.allocate_shared_memory(P_CODE, [BLOCK_N, BLOCK_M], TRANSPOSED_SMEM)
    dst_smem = gl.allocate_shared_memory(DS_CODE, [BLOCK_N, BLOCK_M], TRANSPOSED_SMEM)
    ds_smem = gl.allocate_shared_memory(DS_CODE, [BLOCK_M, BLOCK_N], DS_SMEM)
    VECTOR_SMEM: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    dq_smem = gl.allocate_shared_memory(gl.float32, DQ_TILES.block_type.shape, DQ_TILES.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], VECTOR_SMEM)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], VECTOR_SMEM)

    bases = (Q + first * HEAD_DIM, QT + first, DO + first * HEAD_DIM, DOT + first, LSE + first, DELTA + first)
    stages = (q_smem, qt_smem, do_smem, dot_smem, lse_smem, delta_smem)
    buffers = (k_smem, v_smem, kt_smem.permute((1, 0)), pt_smem, dst_smem, ds_smem, dq_smem, DQ_TILES)
    scales = (qk_scale, dp_factor, grad_factor, s_scale, dp_scale)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    keys_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=COPY_WARPS * 32)  # every copying thread's copies
        mbarrier.init(empty.index(i), count=1)  # one thread of the products' partition, once every warp has left the tile
    mbarrier.init(keys_ready.index(0), count=COPY_WARPS * 32)
    gl.warp_specialize([
        (_consume, (stages, buffers, start_n, kv_first, lo, steps, seq_q, seq_k, bh, scales, ready, empty, keys_ready, DK, DV, DS_AMAX_BITS,
                    SCALES, GROUPS, HEAD_DIM, CAUSAL, STAGES, P_CODE, DS_CODE, KEY_MASK, ROW_MASK)),
        (_produce, (stages, bases, k_smem, v_smem, kt_smem, K, V, KT, ready, empty, keys_ready, kv_first, start_n, lo, steps, seq_q,
                    seq_k, qt_stride, kt_stride, HEAD_DIM, STAGES)),
    ], [COPY_WARPS], [COPY_REGISTERS])


@gluon.jit
def _produce(
    stages, bases, k_smem, v_smem, kt_smem, K, V, KT, ready, empty, keys_ready, kv_first, start_n, lo, steps, seq_q, seq_k, qt_stride,
    kt_stride, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
):
    """The copying partition (COPY_WARPS warps): the program's keys, then each query tile into its
    stage once the products handed it back, each arrival on its barrier."""
    _load_key_tile(k_smem, v_smem, kt_smem, K, V, KT, kv_first, start_n, seq_k, kt_stride, HEAD_DIM)
    async_copy.mbarrier_arrive(keys_ready.index(0), increment_count=False)
    for j in range(steps):
        stage = j % STAGES
        mbarrier.wait(empty.index(stage), (j // STAGES + 1) & 1, pred=j >= STAGES)
        _load_query_tile(stages, stage, *bases, lo + j * BLOCK_M, seq_q, qt_stride, HEAD_DIM)
        async_copy.mbarrier_arrive(ready.index(stage), increment_count=False)


@gluon.jit
def _consume(
    stages, buffers, start_n, kv_first, lo, steps, seq_q, seq_k, bh, scales, ready, empty, keys_ready, DK, DV, DS_AMAX_BITS, SCALES,
    GROUPS: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
    P_CODE: gl.constexpr, DS_CODE: gl.constexpr, KEY_MASK: gl.constexpr, ROW_MASK: gl.constexpr,
):
    """The products' partition (NUM_WARPS warps): the program's query tiles as ``_produce`` copies
    them, then dK, dV and dS's amax out."""
    HALF: gl.constexpr = HEAD_DIM // 2
    S_LAYOUT: gl.constexpr = _accumulator_layout(BLOCK_M, NUM_WARPS)
    KV_LAYOUT: gl.constexpr = _accumulator_layout(HALF, NUM_WARPS)
    KEYS: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    offs_n = start_n + gl.arange(0, BLOCK_N, layout=KEYS)
    dv0 = gl.zeros([BLOCK_N, HALF], gl.float32, KV_LAYOUT)
    dv1 = gl.zeros([BLOCK_N, HALF], gl.float32, KV_LAYOUT)
    dk0 = gl.zeros([BLOCK_N, HALF], gl.float32, KV_LAYOUT)
    dk1 = gl.zeros([BLOCK_N, HALF], gl.float32, KV_LAYOUT)
    ds_amax = gl.zeros([BLOCK_N], gl.float32, KEYS)
    mbarrier.wait(keys_ready.index(0), 0)

    state = (dv0, dv1, dk0, dk1, ds_amax)
    tile_args = (stages, buffers, offs_n, lo, seq_q, seq_k, bh, scales, ready, empty)
    if CAUSAL:
        # The query tiles every row of which sees every key need no mask (the same bits): those from
        # the first past the program's keys on, before the last if its rows do not tile; none if
        # the keys run past seq_k.
        whole_from = steps
        if start_n + BLOCK_N <= seq_k:
            whole_from = gl.minimum(gl.cdiv(start_n + BLOCK_N - lo, BLOCK_M), steps)
        whole_to = gl.maximum(gl.maximum(seq_q - lo, 0) // BLOCK_M, whole_from)
        for j in range(whole_from):
            state = _query_tile(j, state, *tile_args, HEAD_DIM, STAGES, P_CODE, DS_CODE, True, KEY_MASK, ROW_MASK)
        for j in range(whole_from, whole_to):
            state = _query_tile(j, state, *tile_args, HEAD_DIM, STAGES, P_CODE, DS_CODE, False, False, False)
        for j in range(whole_to, steps):
            state = _query_tile(j, state, *tile_args, HEAD_DIM, STAGES, P_CODE, DS_CODE, True, KEY_MASK, ROW_MASK)
    else:  # one loop: split as the causal walk, its loops spilled and ran 1-5% slower (benchmarks/NOTES.md)
        for j in range(steps):
            state = _query_tile(j, state, *tile_args, HEAD_DIM, STAGES, P_CODE, DS_CODE, False, KEY_MASK, ROW_MASK)
    dv0, dv1, dk0, dk1, ds_amax = state
    tma.store_wait(0)

    keys_out = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, KV_LAYOUT))
    d_out = gl.arange(0, HALF, layout=gl.SliceLayout(0, KV_LAYOUT))
    out = (kv_first + keys_out)[:, None] * HEAD_DIM + d_out[None, :]
    keys = keys_out < seq_k
    dv_factor = gl.load(SCALES + 3) * gl.load(SCALES + 1)  # loaded again: registers the loop needs
    _store_half(DV, out, dv0, dv_factor, keys, GROUPS)
    _store_half(DV, out + HALF, dv1, dv_factor, keys, GROUPS)
    grad_factor = scales[2]
    _store_half(DK, out, dk0, grad_factor, keys, GROUPS)
    _store_half(DK, out + HALF, dk1, grad_factor, keys, GROUPS)
    triton_attention_backward.add_amax(DS_AMAX_BITS, ds_amax, offs_n < seq_k)


def dq_tiles(dq: torch.Tensor) -> TensorDescriptor:
    """The TMA descriptor of dQ (batch, heads, Lq, D) in fp32 that the kernel adds its tiles into:
    one (batch, head) at a time, so that a tile's rows past Lq fall outside, not into the next head."""
    b, heads, seq_q, head_dim = dq.shape
    block = [1, BLOCK_M.value, head_dim]
    return TensorDescriptor.from_tensor(dq.view(b * heads, seq_q, head_dim), block, gl.NVMMASharedLayout.get_default_for(block, gl.float32))


def backward(
    q: torch.Tensor, qt: torch.Tensor, k: torch.Tensor, kt: torch.Tensor, v: torch.Tensor,
    do: torch.Tensor, dot: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, scales: torch.Tensor,
    softmax_scale: float, causal: bool, p_dtype: str, ds_dtype: str, grad_dtype: torch.dtype,
    config: Optional[GluonBackwardConfig] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``triton_attention_backward.backward``'s results and arguments, bit for bit those of its
    ``triton_config()`` but for the order in which dQ's tiles meet (``config`` defaults to
    DEFAULT_CONFIG), on Hopper only, for query and key lengths that are multiples of 16."""
    seq_q, seq_k = q.shape[2], k.shape[2]
    if seq_q % GLUON_LENGTH_MULTIPLE or seq_k % GLUON_LENGTH_MULTIPLE:  # cp.async copies 16 bytes of Q^T's, dO^T's and K^T's rows
        raise ValueError(f"the Gluon FP8 flash backward takes query and key lengths that are multiples of {GLUON_LENGTH_MULTIPLE}, not {seq_q} and {seq_k}")
    (dq, dk, dv, ds_amax), inputs = triton_attention_backward.prepared(q, qt, k, kt, v, do, dot, lse, delta, grad_dtype)
    if dq.numel() == 0:  # no query: no dQ tile to describe, dK and dV zero
        return dq, dk.zero_(), dv.zero_(), ds_amax.view(torch.float32)
    b, heads, _, head_dim = q.shape
    config = config or DEFAULT_CONFIG
    tiles = ceil_div(seq_k, BLOCK_N.value)
    launch(
        _backward_kernel, (tiles * b * heads,),
        *inputs, dq_tiles(dq), dk, dv, ds_amax, scales, softmax_scale, seq_q, seq_k, qt.shape[1], kt.shape[1], config.heads_a_section,
        heads // k.shape[1], head_dim, causal, config.num_stages,
        P_CODE=triton_attention_backward.CODES[p_dtype], DS_CODE=triton_attention_backward.CODES[ds_dtype],
        KEY_MASK=seq_k % BLOCK_N.value != 0, ROW_MASK=seq_q % BLOCK_M.value != 0,  # a key past seq_k, a row past seq_q to mask
        num_warps=NUM_WARPS.value,
    )
    return dq, dk, dv, ds_amax.view(torch.float32)
