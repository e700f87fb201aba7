"""CUDA kernel of graphquant::transposed: the contiguous transpose of a 2-D tensor of bytes.

A gradient's per-tensor FP8 columnwise copy is its rowwise bits transposed. Made by this op from
the rowwise copy (rather than traced, where Inductor writes both copies in one kernel while the
gradient's inputs are alive), it is written after those inputs are freed. graphquant.ops.library
registers the kernel as the op's CUDA implementation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphquant.kernels.triton_launch import ceil_div, launch

# 128x128 byte tiles with 8 warps: near a plain copy's bandwidth, where smaller tiles fall well short.
_BLOCK = 128


@triton.jit
def _transpose_kernel(src_ptr, dst_ptr, rows, cols, BLOCK: tl.constexpr):
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = (r[:, None] < rows) & (c[None, :] < cols)
    tile = tl.load(src_ptr + r[:, None].to(tl.int64) * cols + c[None, :], mask=inside)
    tl.store(dst_ptr + c[:, None].to(tl.int64) * rows + r[None, :], tl.trans(tile), mask=tl.trans(inside))


def transposed(data: torch.Tensor) -> torch.Tensor:
    if data.element_size() != 1:
        return data.t().contiguous()
    src = data.contiguous()
    rows, cols = src.shape
    out = torch.empty((cols, rows), dtype=data.dtype, device=data.device)
    grid = (ceil_div(rows, _BLOCK), ceil_div(cols, _BLOCK))
    launch(_transpose_kernel, grid, src.view(torch.uint8), out.view(torch.uint8), rows, cols, BLOCK=_BLOCK, num_warps=8)
    return out
