"""Timing helpers shared by the benchmarks: CUDA-event medians over alternating rounds."""

from __future__ import annotations

import random
import statistics
from typing import Callable

import torch
from tabulate import tabulate

from graphquant import scaled_mm


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
    for r in range(rounds):
        for name in turns(list(fns), r):
            samples[name].append(time_ms(fns[name], **kwargs))
    return {name: statistics.median(values) for name, values in samples.items()}


def turns(names: list[str], round_index: int) -> list[str]:
    """The order of one round: shuffled with the round's own seed, so that no configuration always
    runs after the same one (a GPU that a power-hungry predecessor has throttled runs slower)."""
    order = list(names)
    random.Random(round_index).shuffle(order)
    return order


def print_algorithm_choices() -> None:
    """The cuBLASLt algorithms graphquant chose for the shapes this run multiplied, and their gain."""
    choices = scaled_mm.algorithm_choices()
    if choices:
        print("\ncuBLASLt algorithms chosen (first = the heuristic's first choice, torch._scaled_mm's):")
        print(tabulate(choices, headers=scaled_mm.ALGORITHM_FIELDS, floatfmt=".1f"))
