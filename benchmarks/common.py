"""Timing helpers shared by the benchmarks: CUDA-event medians over alternating rounds."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def time_ms(fn: Callable[[], object], *, warmup: int = 3, reps: int = 10, inner: int = 1) -> float:
    """Median milliseconds of one call of ``fn`` over ``reps`` samples, each sample ``inner``
    back-to-back calls between two CUDA events (so host overhead overlaps the GPU, as in a model)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def alternate(fns: dict[str, Callable[[], object]], *, rounds: int = 3, **kwargs) -> dict[str, float]:
    """Median over ``rounds`` of each function's time, the functions taking turns every round so
    that drift on a shared GPU touches them all alike."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(time_ms(fn, **kwargs))
    return {name: statistics.median(values) for name, values in samples.items()}
