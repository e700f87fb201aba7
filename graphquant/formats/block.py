"""Blockwise FP8: one float32 scale per (rows, cols) block of a 2-D tensor, edges partial."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from graphquant.formats import fp8


def _blocks(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """x zero-padded to whole blocks, viewed as (row blocks, rows, col blocks, cols)."""
    rows, cols = block
    m, k = x.shape
    padded = F.pad(x, (0, -k % cols, 0, -m % rows))
    return padded.reshape(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)


def quantize(
    x: torch.Tensor,
    fp8_dtype: str,
    *,
    block: tuple[int, int],
    epsilon: float,
    pow2: bool,
    scales: Callable[[torch.Tensor, str, float, bool], tuple[torch.Tensor, torch.Tensor]] = fp8.scales,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(data fp8 (M, K), scale_inv float32 (ceil(M/rows), ceil(K/cols))).

    Per block: amax = max |fp32(x)| over the elements that exist (the zero padding cannot raise
    it; a NaN propagates), scale = scale_from_amax (TE's current-scaling rule), data =
    cast_to_fp8(fp32(x) * scale) with one fp32 product, scale_inv = reciprocal(scale).
    ``scales`` makes (scale, scale_inv) from the amaxes: ``fp8.scales``, or the same numbers as
    an op (graphquant::fp8_scales) where the quantize is traced into a graph.
    """
    m, k = x.shape
    blocks = _blocks(x, block)  # the amax in x's dtype is exact (see fp8.tensor_amax)
    amax = blocks.abs().amax(dim=(1, 3)).float()
    if block[0] == 1:  # 1 x cols scales lie outer-dim-major, as cuBLASLt's blockwise GEMM reads them
        scale, scale_inv = (s.t() for s in scales(amax.t().contiguous(), fp8_dtype, epsilon, pow2))
    else:
        scale, scale_inv = scales(amax, fp8_dtype, epsilon, pow2)
    n_rows, rows, n_cols, cols = blocks.shape
    scaled = (blocks.float() * scale[:, None, :, None]).reshape(n_rows * rows, n_cols * cols)
    data = fp8.cast_to_fp8(scaled[:m, :k], fp8_dtype).contiguous()
    return data, scale_inv


def dequantize(data: torch.Tensor, scale_inv: torch.Tensor, *, block: tuple[int, int]) -> torch.Tensor:
    """fp32(data) * its block's scale_inv, one fp32 product per element (float32 (M, K))."""
    m, k = data.shape
    expanded = scale_inv.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    return data.float() * expanded[:m, :k]
