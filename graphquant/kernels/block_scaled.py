"""DeepSeek-V3's block-scaled FP8 GEMM (A in 1x128 blocks, B in 128x128 tiles: fprop and dgrad)
on Hopper by graphquant's own kernel, graphquant._C.block_gemm (csrc/cuda/block_gemm.cu), for the
reductions cuBLASLt's blockwise GEMM takes only padded and the E5M2 gradients it does not take.

Where k / 128 is no multiple of 4 (an MoE expert's 1408 and 2816, Llama-2's 11008), cuBLASLt's
128x128 scaling multiplies by the wrong scales, so scaled_mm pads such a k to a multiple of
TILE_SCALED_K each call, a copy of both operands; this kernel reads the codes and scales as the
representations store them, at any m and n and any k of whole 16 bytes (TMA's rows), faster
than that padded call. Where cuBLASLt takes k (and E4M3 by E4M3) as it is, it is faster
than this kernel, and the plan leaves it those GEMMs (backends.BLOCK_SCALED_GEMM), except where
the output's tiles are few and K long enough (``splits_k``): cuBLASLt leaves most SMs idle there,
and this kernel splits K (Llama-3's down projection at 64 to 256 rows: benchmarks/block_gemm.py).
The numerics are the recipe's: each 128-long block's partial sum on the FP8 tensor cores,
promoted into fp32 with its two scales; where the output's tiles fill few SMs (a few rows of A), K
is split and the splits' fp32 sums added in split order, within the same bound
(fp8.accumulation_bound takes the promoted sums in any order). benchmarks/NOTES.md, block_gemm.py,
has where it stands.
"""

from __future__ import annotations

from typing import Optional

import torch

from graphquant.kernels import devices, native, scaled_mm
from graphquant.kernels.native import has_sm90_kernel
from graphquant.quantizers import Representation

BACKEND = "wgmma fp8 block-scaled gemm"
FAMILIES = frozenset({("fp8_block_1x128", "fp8_block_128x128")})
ELEMENTS = frozenset({("e4m3", "e4m3"), ("e5m2", "e4m3")})  # E4M3 weights, by E4M3 activations or E5M2 gradients
K_MULTIPLE = 16  # TMA reads rows of whole 16 bytes
TILE = 128  # the output tile a CTA computes, and the K of a scale block (block_gemm.cu)
LEAST_SPLIT_BLOCKS = 4  # the fewest K blocks a split takes (block_gemm.cu's call of k_split)


def extension_runs(device: torch.device) -> bool:
    """Whether graphquant's extension runs the kernel on ``device`` (built for its sm_90: sm_90a, wgmma)."""
    return has_sm90_kernel(native.extension_for(device), "block_gemm")


def splits_k(m: int, n: int, k: int, device: torch.device) -> bool:
    """Whether the kernel, left to choose (splits 0), splits K for (m, n, k) on ``device``: where
    its output tiles fill at most half the SMs and K holds two splits (hopper.cuh's k_split)."""
    return devices.few_tiles(m, n, TILE, device) and -(-k // TILE) >= 2 * LEAST_SPLIT_BLOCKS


def gemm(a: Representation, b: Representation, out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None, splits: int = 0) -> torch.Tensor:
    """out (m, n) = A @ B^T (+ bias) for A's 1x128 blocks and B's 128x128 tiles, each with the
    reduction dim last (scaled_mm.k_last), their scales (outer, k blocks) as stored; ``splits``:
    K's split (0: the kernel's choice for the GPU's SMs)."""
    (data_a, _), (data_b, _) = scaled_mm.k_last(a), scaled_mm.k_last(b)
    return native.extension_for(data_a.device).block_gemm(data_a, data_b, a.scale, b.scale, out_dtype, bias, splits)
