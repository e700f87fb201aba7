"""Timing helpers shared by the benchmarks: CUDA-event (or, on the CPU, wall-clock) medians over
alternating rounds."""

from __future__ import annotations

import cProfile
import collections
import ctypes
import functools
import json
import pstats
import random
import statistics
import sys
import tempfile
import time
from typing import Callable, Optional

import torch
from tabulate import tabulate

from graphquant.kernels import scaled_mm

HEAT_STEPS = 8  # steps queued ahead of a profiled one
PROFILED_STEP = "profiled step"


@functools.lru_cache(maxsize=None)
def _nvml_device(cuda_index: int) -> Optional[tuple[ctypes.CDLL, ctypes.c_void_p]]:
    """NVML and its handle of CUDA device ``cuda_index``, or None where either is missing."""
    try:
        index = torch.cuda._get_nvml_device_index(cuda_index)  # CUDA_VISIBLE_DEVICES taken into account
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except (AttributeError, OSError, RuntimeError):
        return None
    handle = ctypes.c_void_p()
    if nvml.nvmlInit_v2() != 0 or nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(handle)) != 0:
        return None
    return nvml, handle


def gpu_energy_j() -> Optional[float]:
    """The current GPU's energy counter in joules (NVML's total since the driver loaded), or None
    where NVML cannot read it. FP8 training steps run at the GPU's power limit, so their time
    follows their energy: joules per step say where a step's time goes."""
    device = _nvml_device(torch.cuda.current_device())
    if device is None:
        return None
    nvml, handle = device
    millijoules = ctypes.c_ulonglong()
    if nvml.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(millijoules)) != 0:
        return None
    return millijoules.value / 1000


def time_ms(
    fn: Callable[[], object], *, warmup: int = 3, reps: int = 10, inner: int = 1, queued: int = 0,
    joules: Optional[list[float]] = None, host: Optional[list[float]] = None,
) -> float:
    """Median milliseconds of one call of ``fn`` over ``reps`` samples, each sample ``inner``
    back-to-back calls between two CUDA events (so host overhead overlaps the GPU, as in a model).
    ``queued`` calls are issued before the start event, so that the GPU is already busy when a
    sample begins and the first timed call's host work is hidden as every later one's is (a
    serving loop's steady state); without them each sample holds one call's host time.
    ``joules``, if given, receives each sample's GPU energy per call where NVML can read it;
    ``host`` each sample's host milliseconds per call (the calls' wall clock, the GPU not waited
    for): where it comes near the events' time, the host, not the GPU, set the pace."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()  # the warmup's energy is not the first sample's
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(queued):
            fn()
        before = gpu_energy_j() if joules is not None else None
        start.record()
        began = time.perf_counter()
        for _ in range(inner):
            fn()
        issued = time.perf_counter()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / inner)
        if host is not None:
            host.append((issued - began) * 1e3 / inner)
        after = gpu_energy_j() if before is not None else None
        if after is not None:
            joules.append((after - before) / inner)
    return statistics.median(times)


def fp8_gemm_heat(gemms: int = 6) -> Callable[[], None]:
    """A function that runs ``gemms`` 16384x14336x4096 FP8 GEMMs: between them the GPU sits at its
    power limit with the SM clock capped, as in a training step, where a kernel whose instructions
    took less time than its bytes at boost clock may no longer."""
    a = torch.randn(16384, 4096, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(14336, 4096, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")

    def heat() -> None:
        for _ in range(gemms):
            torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16)

    return heat


def time_us_once(fn: Callable[[], object], heat: Optional[Callable[[], None]]) -> float:
    """Microseconds of one call of ``fn``: alone on the GPU after an idle pause (``heat`` None, the
    boost clock), or between two calls of ``heat`` (the clock a training step runs at)."""
    if heat is None:
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000)
    else:
        heat()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    if heat is not None:
        heat()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3


def idle_and_capped_us(fns: dict, rounds: int = 5) -> dict:
    """(idle, between FP8 GEMMs) median microseconds of each function, over ``rounds`` turns each;
    all idle samples first: two milliseconds after a GEMM the clock is still capped."""
    heat = fp8_gemm_heat()
    samples: dict = {key: [] for key in fns}
    for warm in (None, heat):
        for _ in range(rounds):
            for key, fn in fns.items():
                samples[key].append(time_us_once(fn, warm))
    return {key: (statistics.median(s[:rounds]), statistics.median(s[rounds:])) for key, s in samples.items()}


def wall_ms(fn: Callable[[], object], *, warmup: int = 1, reps: int = 3) -> float:
    """Median wall-clock milliseconds of one call of ``fn`` over ``reps`` calls: time_ms where
    there are no CUDA events (the CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def seconds(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    """Wall-clock seconds of one call of ``fn`` with the device drained around it, and its result:
    a first call's, which compiles."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    result = fn()
    sync()
    return time.perf_counter() - start, result


def graphed(fn: Callable[[], object], calls: int) -> Callable[[], None]:
    """A function that replays ``calls`` calls of ``fn`` from one CUDA graph (``fn`` run once first,
    outside the capture, so that Triton tunes and compiles there): the GPU's time alone, where a
    small kernel's eager calls would time the host's Python that issues them."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay


def alternate(
    fns: dict[str, Callable[[], object]],
    *,
    rounds: int = 3,
    joules: Optional[dict[str, float]] = None,
    host: Optional[dict[str, float]] = None,
    timer: Callable[..., float] = time_ms,
    **kwargs,
) -> dict[str, float]:
    """Median over ``rounds`` of each function's time by ``timer`` (``kwargs`` go to it), the
    functions taking turns every round so that drift on a shared GPU touches them all alike.
    ``joules``, if given, receives each function's mean GPU energy per call, where NVML can read
    it: the mean, because NVML's counter advances in steps, so one sample sees a whole number of
    them, and a median over samples only a few steps long would keep the more frequent count.
    ``host``, if given, receives each function's median host milliseconds per call (time_ms's)."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    energy: dict[str, list[float]] = {name: [] for name in fns}
    issue: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        for name in turns(list(fns), r):
            extra = {"joules": energy[name]} if joules is not None else {}
            if host is not None:
                extra["host"] = issue[name]
            samples[name].append(timer(fns[name], **extra, **kwargs))
    if joules is not None:
        joules.update({name: statistics.fmean(values) for name, values in energy.items() if values})
    if host is not None:
        host.update({name: statistics.median(values) for name, values in issue.items() if values})
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


def training_step(model: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    """One forward and backward of ``model`` on ``x`` with upstream gradient ``grad``, the
    gradients cleared first (so a step allocates what a training step does)."""

    def step() -> None:
        x.grad = None
        for p in model.parameters():
            p.grad = None
        model(x).backward(grad)

    return step


def warm_peak_gib(step: Callable[[], None]) -> float:
    """Run ``step`` twice (compile, warm up), then once more: the GiB it allocated at its peak
    on top of what was allocated before it."""
    step(); step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**30


def profile(name: str, step) -> None:
    """Print how long the host takes to issue one step against the GPU's time for it, the CUDA
    kernels of one step of ``name`` by total time (at the clock of back-to-back steps), then where
    the GPU sat idle: the largest gaps between kernels, the kernels around each, and whether the
    next kernel's launch came late (host-bound) or was queued in time (something else)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    host, whole = [], []
    for _ in range(5):  # without the profiler, whose own host work would make any step look host-bound
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        host.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        whole.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)  # ~50 ms of GPU clock cycles queued ahead of the step
    start = time.perf_counter()
    step()
    behind = time.perf_counter() - start
    torch.cuda.synchronize()
    print(f"--- {name}: the host returns from one step after {sorted(host)[2] * 1e3:.2f} ms, the GPU finishes it "
          f"after {sorted(whole)[2] * 1e3:.2f} ms (medians of 5, no profiler); with the GPU ~50 ms behind, the host "
          f"returns after {behind * 1e3:.2f} ms (a step that waits for the GPU would take those 50 ms too)", file=sys.stderr)
    with cProfile.Profile() as python_profile:
        step()
        torch.cuda.synchronize()
    print(f"--- {name}: the host's functions by own time (cProfile, one step)", file=sys.stderr)
    pstats.Stats(python_profile, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    # Steps queued back to back hold the GPU at its power limit (a capped SM clock), where a step
    # after a pause runs its first tens of ms at boost: the profiled step runs behind HEAT_STEPS of
    # them, queued inside the profile (starting one waits for the GPU), and only the kernels
    # launched within its annotation are counted.
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(HEAT_STEPS):
            step()
        with torch.profiler.record_function(PROFILED_STEP):
            step()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        events = json.load(open(trace.name))["traceEvents"]
    (mark,) = [e for e in events if e.get("name") == PROFILED_STEP and e.get("cat") == "user_annotation"]
    launches = {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
        and mark["ts"] <= e["ts"] <= mark["ts"] + mark["dur"]
    }
    device = sorted(
        (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e["args"].get("correlation") in launches),
        key=lambda e: e["ts"],
    )
    totals: dict[str, list[float]] = {}
    for e in device:
        totals.setdefault(e["name"], []).append(e["dur"])
    rows = sorted(([sum(d) / 1e3, len(d), n[:110]] for n, d in totals.items()), reverse=True)
    print(f"--- {name}: CUDA kernels of one step", file=sys.stderr)
    print(tabulate(rows[:40], headers=["ms", "calls", "kernel"], floatfmt=".3f"), file=sys.stderr)
    busy = sum(e["dur"] for e in device)
    span = device[-1]["ts"] + device[-1]["dur"] - device[0]["ts"]
    gaps = []
    for before, after in zip(device, device[1:]):
        gap = after["ts"] - (before["ts"] + before["dur"])
        launched = launches.get(after["args"].get("correlation"))
        late = launched is not None and launched > before["ts"] + before["dur"]
        gaps.append((gap, late, before["name"][:60], after["name"][:60]))
    host = sum(g for g, late, *_ in gaps if g > 0 and late)
    print(f"--- {name}: device busy {busy / 1e3:.2f} ms of {span / 1e3:.2f} ms; idle {(span - busy) / 1e3:.2f} ms, "
          f"{host / 1e3:.2f} ms of it waiting for a late launch", file=sys.stderr)
    rows = [[f"{g:.0f}", "late launch" if late else "queued", b, a] for g, late, b, a in sorted(gaps, reverse=True)[:6]]
    print(tabulate(rows, headers=["gap (us)", "next kernel", "after", "before"]), file=sys.stderr)


def cuda_kernels(call: Callable[[], object], warmup: int = 3) -> tuple[list[tuple[str, int, float]], float]:
    """(name, launches, GPU us) of each CUDA kernel of one ``call`` after ``warmup`` calls (kernels
    inside CUDA graph replays included), and the us from the first kernel's start to the last one's end."""
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        call()
        torch.cuda.synchronize()
    launches = [e for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for e in launches:
        by_name[e.name][0] += 1
        by_name[e.name][1] += e.time_range.elapsed_us()
    span = max(e.time_range.end for e in launches) - min(e.time_range.start for e in launches) if launches else 0.0
    return [(name, count, us) for name, (count, us) in by_name.items()], span
