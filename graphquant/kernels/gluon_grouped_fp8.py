"""The FP8 grouped GEMM of graphquant.kernels.triton_grouped_fp8 on Hopper, written in Gluon
(Triton's explicit-layout dialect) to overlap its promoted sums with the tensor cores' work.

Both kernels sum every 32 products in a fresh tensor-core accumulator and add it into fp32 in
the same order (block scales: each 128-long K block's four sums, then scaled), so their results
are the same bits. Triton's compiler waits for each 32-long wgmma before adding it; here two
run in turn, the second issued before the first is added. The operands come in by TMA through
a ring of 32-long K stages. Same operands, layouts, scales and outputs as the Triton kernels
(their docstrings), whose wrappers launch this one where ``runs`` says it can.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


PRODUCTS = gl.constexpr(32)  # K of one FP8 wgmma: the products summed before fp32 takes them
BLOCK_STEPS = gl.constexpr(4)  # K steps of one block scale (128 long)


@gluon.jit
def _load(a_desc, b_desc, a_smem, b_smem, bars, step, steps, a_row, a_k, b_row, b_k, STAGES: gl.constexpr):
    """Start the TMA copies of K step ``step`` (if there is one) into its stage."""
    stage = step % STAGES
    live = step < steps
    bar = bars.index(stage)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=live)
    k = step * PRODUCTS
    tma.async_copy_global_to_shared(a_desc, [a_row, a_k + k], bar, a_smem.index(stage), pred=live)
    tma.async_copy_global_to_shared(b_desc, [b_row, b_k + k], bar, b_smem.index(stage), pred=live)


@gluon.jit
def _product(a_smem, b_smem, bars, step, zero, STAGES: gl.constexpr):
    """Issue the 32 products of K step ``step`` into a fresh accumulator, once its stage has landed."""
    stage = step % STAGES
    mbarrier.wait(bars.index(stage), (step // STAGES) & 1)
    return warpgroup_mma(a_smem.index(stage), b_smem.index(stage).permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def _round(
    total, a_desc, b_desc, a_smem, b_smem, bars, step, steps, a_row, a_k, b_row, b_k, zero,
    STAGES: gl.constexpr, IN_FLIGHT: gl.constexpr, FRESH: gl.constexpr,
):
    """``total`` plus the sums of K steps step .. step + IN_FLIGHT - 1 (2 or 4), added in
    order, each as soon as it is done while the later ones run (FRESH: the first sum is the
    total); each step's stage refilled with step + STAGES once read. All are retired by the
    round's end: wgmmas left in flight across the loop are serialized by the compiler."""
    p0 = _product(a_smem, b_smem, bars, step, zero, STAGES)
    p1 = _product(a_smem, b_smem, bars, step + 1, zero, STAGES)
    if IN_FLIGHT == 4:
        p2 = _product(a_smem, b_smem, bars, step + 2, zero, STAGES)
        p3 = _product(a_smem, b_smem, bars, step + 3, zero, STAGES)
    first = warpgroup_mma_wait(IN_FLIGHT - 1, deps=[p0])
    if FRESH:
        total = first
    else:
        total = total + first
    _load(a_desc, b_desc, a_smem, b_smem, bars, step + STAGES, steps, a_row, a_k, b_row, b_k, STAGES)
    total = total + warpgroup_mma_wait(IN_FLIGHT - 2, deps=[p1])
    _load(a_desc, b_desc, a_smem, b_smem, bars, step + 1 + STAGES, steps, a_row, a_k, b_row, b_k, STAGES)
    if IN_FLIGHT == 4:
        total = total + warpgroup_mma_wait(1, deps=[p2])
        _load(a_desc, b_desc, a_smem, b_smem, bars, step + 2 + STAGES, steps, a_row, a_k, b_row, b_k, STAGES)
        total = total + warpgroup_mma_wait(0, deps=[p3])
        _load(a_desc, b_desc, a_smem, b_smem, bars, step + 3 + STAGES, steps, a_row, a_k, b_row, b_k, STAGES)
    return total


@gluon.jit
def _scaled_sum(
    a_desc, b_desc, a_row, a_k, b_row, b_k, steps, sa_at, sa_in, sa_k, sb_at, sb_in, sb_k, kb0,
    layout: gl.constexpr, STAGES: gl.constexpr, IN_FLIGHT: gl.constexpr, BLOCK_SCALED: gl.constexpr,
):
    """The scaled fp32 product of a tile over ``steps`` K steps (a multiple of IN_FLIGHT, and of
    a block's where BLOCK_SCALED) of A[a_row:, a_k:] B[b_row:, b_k:]^T: each step's 32 products
    summed by the tensor cores and added in order; the scales (at ``sa_at + kb * sa_k`` for K
    block kb, 0 where not ``sa_in``; B's alike) applied to each 128-long K block's sum (its four
    steps') where BLOCK_SCALED, else once to the whole sum."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, PRODUCTS], a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, PRODUCTS], b_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for stage in gl.static_range(STAGES):
        mbarrier.init(bars.index(stage), count=1)
    fence_async_shared()
    for step in gl.static_range(STAGES):
        _load(a_desc, b_desc, a_smem, b_smem, bars, step, steps, a_row, a_k, b_row, b_k, STAGES)
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
    if BLOCK_SCALED:
        for step in range(0, steps, BLOCK_STEPS):
            block = zero
            for first in gl.static_range(0, BLOCK_STEPS, IN_FLIGHT):
                block = _round(
                    block, a_desc, b_desc, a_smem, b_smem, bars, step + first, steps, a_row, a_k, b_row, b_k, zero,
                    STAGES, IN_FLIGHT, first == 0,
                )
            kb = kb0 + step // BLOCK_STEPS
            sa = gl.load(sa_at + kb * sa_k, mask=sa_in, other=0.0)
            sb = gl.load(sb_at + kb * sb_k, mask=sb_in, other=0.0)
            acc = acc + block * (sa[:, None] * sb[None, :])
    else:
        for step in range(0, steps, IN_FLIGHT):
            acc = _round(acc, a_desc, b_desc, a_smem, b_smem, bars, step, steps, a_row, a_k, b_row, b_k, zero, STAGES, IN_FLIGHT, False)
        sa = gl.load(sa_at, mask=sa_in, other=0.0)
        sb = gl.load(sb_at, mask=sb_in, other=0.0)
        acc = acc * (sa[:, None] * sb[None, :])
    for stage in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(stage))
    return acc


@gluon.jit
def _tile_of(pid, tiles_m, tiles_n, GROUP_TILES: gl.constexpr):
    """(tile row, tile column) of program ``pid``, GROUP_TILES tile rows per column in turn."""
    width = GROUP_TILES * tiles_n
    first = (pid // width) * GROUP_TILES
    height = gl.minimum(tiles_m - first, GROUP_TILES)
    return first + (pid % width) % height, (pid % width) // height


@gluon.jit
def _tokens_by_experts(
    a_desc, b_desc, out_ptr, row_group_ptr, source_ptr, ends_ptr, groups, rows, n, k, b_group_row, b_group_k, stride_om,
    sa_ptr, sa_i, sa_k, sb_ptr, sb_g, sb_i, sb_k,
    BLOCK_SCALED: gl.constexpr, A_ROWS: gl.constexpr, B_ROWS: gl.constexpr, GROUP_TILES: gl.constexpr, STAGES: gl.constexpr,
    IN_FLIGHT: gl.constexpr,
):
    """out[source[r], :] = A[r, :] @ B_g for the padded rows r of one tile; B_g's tile starts at
    stored row col0 + g * b_group_row, column g * b_group_k; tiles past the last group's end sum
    nothing."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, BLOCK_N, PRODUCTS])
    pid_m, pid_n = _tile_of(gl.program_id(0), gl.cdiv(rows, BLOCK_M), gl.cdiv(n, BLOCK_N), GROUP_TILES)
    row0 = pid_m * BLOCK_M
    col0 = pid_n * BLOCK_N
    group = gl.load(row_group_ptr + row0)
    # Whole rounds of K steps: past k, TMA reads zeros.
    ROUND: gl.constexpr = PRODUCTS * (BLOCK_STEPS if BLOCK_SCALED else IN_FLIGHT)
    steps = gl.cdiv(k, ROUND) * (ROUND // PRODUCTS) * (row0 < gl.load(ends_ptr + groups - 1)).to(gl.int32)
    rows_at = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    in_rows = rows_at < rows
    in_cols = cols < n
    sa_at = sa_ptr + (rows_at // A_ROWS).to(gl.int64) * sa_i
    sb_at = sb_ptr + group * sb_g + (cols // B_ROWS).to(gl.int64) * sb_i
    b_row = (col0 + group * b_group_row).to(gl.int32)
    b_k = (group * b_group_k).to(gl.int32)
    acc = _scaled_sum(
        a_desc, b_desc, row0, 0, b_row, b_k, steps, sa_at, in_rows, sa_k, sb_at, in_cols, sb_k, 0, layout, STAGES, IN_FLIGHT,
        BLOCK_SCALED,
    )
    # Stored from a layout of 16-byte row pieces (the accumulator's own scatters 4-byte ones).
    store: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    out = gl.convert_layout(acc.to(out_ptr.dtype.element_ty), store)
    rows_at = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, store))
    cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, store))
    source = gl.load(source_ptr + rows_at)
    out_at = source[:, None] * stride_om + cols[None, :]
    gl.store(out_ptr + out_at, out, mask=(source[:, None] >= 0) & (cols < n)[None, :])


@gluon.jit
def _tokens_by_tokens(
    a_desc, b_desc, out_ptr, ends_ptr, m, n, sa_ptr, sa_g, sa_i, sa_k, sb_ptr, sb_g, sb_i, sb_k,
    BLOCK_SCALED: gl.constexpr, A_ROWS: gl.constexpr, B_ROWS: gl.constexpr, GROUP_TILES: gl.constexpr, STAGES: gl.constexpr,
    IN_FLIGHT: gl.constexpr,
):
    """out[g] = A_g^T B_g over group g's padded rows, A and B stored transposed; an empty
    group's product is 0."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, BLOCK_N, PRODUCTS])
    group = gl.program_id(1)
    pid_m, pid_n = _tile_of(gl.program_id(0), gl.cdiv(m, BLOCK_M), gl.cdiv(n, BLOCK_N), GROUP_TILES)
    end = gl.load(ends_ptr + group)
    begin = gl.load(ends_ptr + group - 1, mask=group > 0, other=0)
    row0 = pid_m * BLOCK_M
    col0 = pid_n * BLOCK_N
    ms = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    ns = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    in_m = ms < m
    in_n = ns < n
    sa_at = sa_ptr + group * sa_g + (ms // A_ROWS).to(gl.int64) * sa_i
    sb_at = sb_ptr + group * sb_g + (ns // B_ROWS).to(gl.int64) * sb_i
    acc = _scaled_sum(
        a_desc, b_desc, row0, begin, col0, begin, (end - begin) // PRODUCTS, sa_at, in_m, sa_k, sb_at, in_n, sb_k,
        begin // (BLOCK_STEPS * PRODUCTS), layout, STAGES, IN_FLIGHT, BLOCK_SCALED,
    )
    store: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    out = gl.convert_layout(acc.to(out_ptr.dtype.element_ty), store)
    ms = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, store))
    ns = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, store))
    out_at = group.to(gl.int64) * m * n + ms[:, None].to(gl.int64) * n + ns[None, :]
    gl.store(out_ptr + out_at, out, mask=(ms < m)[:, None] & (ns < n)[None, :])


class Tile(NamedTuple):
    """A launch configuration: the output tile, its warps, the K steps loading ahead (stages)
    and those summed at once (in_flight: 2 or 4, each a fresh accumulator of the tile's)."""

    block_m: int
    block_n: int
    warps: int
    stages: int
    in_flight: int = 2


# Chosen by benchmarks/grouped_gemm_sweep.py on an H200 (by whether the scales are per block,
# whose partial sums take a tile's registers more).
TILES = {False: Tile(128, 128, 8, 12), True: Tile(128, 64, 8, 12, in_flight=4)}


def runs(*codes: torch.Tensor) -> bool:
    """Whether this kernel takes operands ``codes``: on Hopper (wgmma), where TMA can copy them
    (16-byte aligned rows)."""
    return all(
        t.is_cuda and torch.cuda.get_device_capability(t.device) == (9, 0) and t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0
        for t in codes
    )


def _descriptor(data: torch.Tensor, rows: int) -> TensorDescriptor:
    """A TMA descriptor of ``data`` (K contiguous) that copies ``rows`` x 32 tiles."""
    element = gl.float8e5 if data.dtype == torch.float8_e5m2 else gl.float8e4nv
    block = [rows, PRODUCTS.value]
    return TensorDescriptor.from_tensor(data, block, gl.NVMMASharedLayout.get_default_for(block, element))


def tokens_by_experts(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, a_group: torch.Tensor, source: torch.Tensor, ends: torch.Tensor,
    n: int, b_group_row: int, b_group_k: int, sa, sb, block_scaled: bool, group_tiles: int,
) -> None:
    """triton_grouped_fp8.tokens_by_experts's launch: A (rows, k) and B's codes, B_g's tile at
    stored row col0 + g * b_group_row, column g * b_group_k."""
    rows, k = a.shape
    tile = TILES[block_scaled]
    grid = (triton.cdiv(rows, tile.block_m) * triton.cdiv(n, tile.block_n),)
    _tokens_by_experts[grid](
        _descriptor(a, tile.block_m), _descriptor(b, tile.block_n), out, a_group, source, ends, ends.shape[0], rows, n, k,
        b_group_row, b_group_k, out.stride(0), sa.tensor, sa.row, sa.block, sb.tensor, sb.group, sb.row, sb.block,
        BLOCK_SCALED=block_scaled, A_ROWS=sa.rows, B_ROWS=sb.rows, GROUP_TILES=group_tiles, STAGES=tile.stages, IN_FLIGHT=tile.in_flight, num_warps=tile.warps,
    )


def tokens_by_tokens(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, ends: torch.Tensor, sa, sb, block_scaled: bool, group_tiles: int
) -> None:
    """triton_grouped_fp8.tokens_by_tokens's launch: A and B's codes, stored transposed, into
    out (groups, m, n)."""
    groups, m, n = out.shape
    tile = TILES[block_scaled]
    grid = (triton.cdiv(m, tile.block_m) * triton.cdiv(n, tile.block_n), groups)
    _tokens_by_tokens[grid](
        _descriptor(a, tile.block_m), _descriptor(b, tile.block_n), out, ends, m, n,
        sa.tensor, sa.group, sa.row, sa.block, sb.tensor, sb.group, sb.row, sb.block,
        BLOCK_SCALED=block_scaled, A_ROWS=sa.rows, B_ROWS=sb.rows, GROUP_TILES=group_tiles, STAGES=tile.stages, IN_FLIGHT=tile.in_flight, num_warps=tile.warps,
    )
