"""The arrival counters of K-split GEMM launches: a zero int32 an output tile, per device and
stream, which the last of a tile's programs (or CTAs) to arrive finds at splits - 1; it then adds
every split's partial sums in split order (the same bits whichever arrives last) and sets the
counter back to zero. Launches on one stream run one after another and share them (each leaves
them zero); launches on two streams may overlap and count apart. Never freed, grown by
replacement: a CUDA graph keeps the address it captured. The decode GEMM
(graphquant.kernels.triton_decode) and the mixed-input GEMM (csrc/cuda/mixed_gemm.cu) count here.
"""

from __future__ import annotations

import concurrent.futures

import torch

COUNTERS: dict[tuple, torch.Tensor] = {}
RETIRED: list[torch.Tensor] = []
_LEAST = 4096


def zeroed(device: torch.device, tiles: int) -> torch.Tensor:
    """At least ``tiles`` arrival counters, zero, for a launch on the current stream of ``device``."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    counters = COUNTERS.get((device, stream))
    if counters is None or counters.numel() < tiles:
        if counters is not None:
            RETIRED.append(counters)
        counters = COUNTERS[device, stream] = _zeros_outside_graph_pools(max(1 << (tiles - 1).bit_length(), _LEAST), device)
    return counters


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
