"""The arrival counters of K-split GEMM launches (graphquant.kernels.triton_decode): a zero
int32 a tile, which the programs sharing the tile count up, the last to arrive adding every
split's partial sums in split order and setting the counter back to zero for the next launch.

Per device and stream: launches on one stream run one after another and share them (each leaves
them zero), launches on two streams may overlap and count apart. Never freed, grown by
replacement: a CUDA graph keeps the address it captured.
"""

from __future__ import annotations

import concurrent.futures

import torch

COUNTERS: dict[tuple, torch.Tensor] = {}
RETIRED: list[torch.Tensor] = []
LEAST = 4096


def counters(device: torch.device, tiles: int) -> torch.Tensor:
    """At least ``tiles`` arrival counters, zero, for a launch on the current stream of ``device``."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    held = COUNTERS.get((device, stream))
    if held is None or held.numel() < tiles:
        if held is not None:
            RETIRED.append(held)
        held = COUNTERS[device, stream] = _zeros_outside_graph_pools(max(1 << (tiles - 1).bit_length(), LEAST), device)
    return held


def _zeros_outside_graph_pools(size: int, device: torch.device) -> torch.Tensor:
    """``size`` int32 zeros that no CUDA graph's memory pool owns. While a graph tree warms up or
    records, the allocations of its thread (or stream) come from the graph's pool, which the tree
    may give to other tensors between replays: the counters are made by another thread, on a
    stream of its own. While the current stream is captured they are made in the capture instead
    (that graph's pool keeps them as long as the library does, and its replays zero them first)."""
    if device.type != "cuda":
        return torch.zeros(size, dtype=torch.int32, device=device)
    with torch.cuda.device(device):
        if torch.cuda.is_current_stream_capturing():
            return torch.zeros(size, dtype=torch.int32, device=device)

    def make() -> torch.Tensor:
        side = torch.cuda.Stream(device)
        with torch.cuda.stream(side):
            zeros = torch.zeros(size, dtype=torch.int32, device=device)
        side.synchronize()
        return zeros

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as thread:
        return thread.submit(make).result()
