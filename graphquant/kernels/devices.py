"""A device's compute capability, which decides what each kernel can run there, and its SMs, which
decide how a GEMM is split."""

from __future__ import annotations

import functools
from typing import Optional

import torch


def capability(device: torch.device) -> Optional[tuple[int, int]]:
    """(major, minor) of a CUDA device, None for any other: asked of the driver once per device,
    as launches that pick their kernels by it are on the host's path of every call."""
    return _of(device) if device.type == "cuda" else None


@functools.lru_cache(maxsize=None)
def _of(device: torch.device) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(device))


@functools.lru_cache(maxsize=None)
def multiprocessors(device: torch.device) -> int:
    """The SMs of a CUDA device; 4 for any other (Triton's interpreter runs a kernel's logic alone)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def few_tiles(m: int, n: int, tile: int, device: torch.device) -> bool:
    """Whether an output of (m, n) in ``tile`` x ``tile`` tiles fills at most half ``device``'s SMs,
    where a GEMM gains by splitting K (a few rows of A through a 4096-column weight)."""
    return 2 * -(-m // tile) * -(-n // tile) <= multiprocessors(device)
