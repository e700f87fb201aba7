"""The experimental NVFP4 decode kernels (nvfp4_decode_lab.py) timed beside bf16 F.linear and the
library's decode GEMM (triton_decode.gemm, its default tiling) at a Llama-3-8B FFN's weights.

    python benchmarks/decode_nvfp4.py [--rows 1,16] [--jobs 5] [--budget 120]

Every variant is first compiled and run once per case in one of --jobs processes, its product
checked against the float64 product of the dequantized operands (decode_tune.py's bound); then
this process times the variants that passed, each as CUDA graphs of decode_gemm.CALLS calls, and
prints one table: microseconds and speedup over bf16 per variant.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import sys
import time

import torch
import torch.nn.functional as F
from tabulate import tabulate

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import nvfp4_decode_lab as lab  # noqa: E402
from common import alternate  # noqa: E402
from decode_gemm import CALLS, WEIGHTS, graphed  # noqa: E402
from decode_tune import excess, operands  # noqa: E402

from graphquant.kernels import triton_decode  # noqa: E402

V = lab.Variant
# (kernel, asm, BLOCK_N, BLOCK_K, BLOCK_M, warps, stages, programs an SM)
ONE_ROW = [
    V("fma", True, 64, 512, 1, 4, 2, 4),
    V("fma", True, 64, 512, 1, 4, 2, 8),
    V("fma", True, 32, 512, 1, 4, 2, 8),
    V("fma", True, 64, 256, 1, 4, 2, 8),
    V("fma", True, 128, 256, 1, 8, 2, 4),
    V("fma", True, 128, 512, 1, 8, 2, 2),
    V("fma", True, 32, 256, 1, 2, 2, 16),
    V("fma", False, 64, 512, 1, 4, 2, 4),
]
MXFP8_ONE_ROW = [
    V("fma", True, 64, 256, 1, 4, 2, 4),
    V("fma", True, 64, 256, 1, 4, 2, 8),
    V("fma", True, 32, 512, 1, 4, 2, 8),
    V("fma", True, 128, 256, 1, 8, 2, 4),
]
MXFP8_TENSOR_CORES = [V("mma", True, 64, 256, 16, 4, 3, 8), V("mma", True, 128, 256, 16, 8, 3, 4)]
TENSOR_CORES = [  # the split dots first: one dot's join tree compiles slowly
    V("mma16", True, 64, 256, 16, 4, 3, 8),
    V("mma16", True, 64, 512, 16, 4, 2, 8),
    V("mma16", True, 128, 256, 16, 8, 2, 4),
    V("mma8", True, 64, 256, 16, 4, 3, 8),
    V("mma8", True, 128, 256, 16, 8, 2, 4),
    V("mma", True, 64, 128, 16, 4, 3, 8),
    V("mma", True, 128, 128, 16, 8, 3, 4),
]


def tasks_of(cases) -> list[tuple]:
    """(format, variant, the cases it takes) for every variant."""
    every = [("nvfp4", v) for v in ONE_ROW] + [("mxfp8", v) for v in MXFP8_ONE_ROW] + [("nvfp4", v) for v in TENSOR_CORES]
    every += [("mxfp8", v) for v in MXFP8_TENSOR_CORES]
    defaults = [(name, None, cases) for name in ("nvfp4", "mxfp8")]  # compiled (autotuned) there too
    return defaults + [
        (name, variant, [case for case in cases if case[1] in ([1] if variant.kernel == "fma" else [1, 16])])
        for name, variant in every
    ]


def check(task) -> list[tuple]:
    """One variant (compiled once) run on every case it takes, each with its excess over the bound."""
    name, variant, cases = task
    results = []
    for case in cases:
        (n, k), m = case
        a, b = operands(name, m, n, k)
        try:
            out = triton_decode.gemm(a, b, torch.bfloat16) if variant is None else lab.gemm(a, b, torch.bfloat16, variant)
            results.append(((name, *case), variant, excess(name, out, a, b), ""))
        except Exception as error:  # noqa: BLE001 (a variant that does not compile is a result)
            results.append(((name, *case), variant, None, str(error).splitlines()[0][:100]))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--jobs", type=int, default=5)
    parser.add_argument("--budget", type=float, default=120.0, help="seconds, from the start, after which no case is timed")
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget
    cases = [(weight, int(m)) for m in args.rows.split(",") for weight in WEIGHTS]
    tasks = [task for task in tasks_of(cases) if task[2]]
    pool = concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"))
    futures = [pool.submit(check, task) for task in tasks]
    # Half the budget at most: a variant still compiling then is dropped, its worker ended.
    concurrent.futures.wait(futures, timeout=args.budget * 0.5)
    checked = [result for future in futures if future.done() and not future.exception() for result in future.result()]
    cancelled = sum(not future.done() for future in futures)
    workers = list(pool._processes.values())
    pool.shutdown(wait=False, cancel_futures=True)
    for worker in workers:
        worker.terminate()
    print(f"{len(futures) - cancelled}/{len(futures)} variants checked at {time.monotonic() - deadline + args.budget:.0f} s", flush=True)
    for task, future in zip(tasks, futures):
        if not future.done() or future.exception():
            print(f"NOT CHECKED {task[0]} {task[1]}: {'still compiling' if not future.done() else future.exception()}", flush=True)
    good = {}
    for case, variant, ex, error in checked:
        if ex is None or ex > 0:
            print(f"FAILED {case} {variant}: {error or f'outside the bound by {ex:.3g}'}", flush=True)
        elif variant is not None:
            good.setdefault(case, []).append(variant)

    rows = []
    order = [(name, *case) for case in cases if case[1] == 1 for name in ("nvfp4", "mxfp8")]
    for name, (n, k), m in order + [(name, *case) for case in cases if case[1] != 1 for name in ("nvfp4", "mxfp8")]:
        if time.monotonic() > deadline:
            print(f"budget spent: {name} {(n, k)} m={m} and the cases after it not timed", flush=True)
            break
        if not good.get((name, (n, k), m)):
            continue
        a, b = operands(name, m, n, k)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        fns = {"bf16 F.linear": lambda: F.linear(x, w), "library default": lambda: triton_decode.gemm(a, b, torch.bfloat16)}
        for variant in good[(name, (n, k), m)]:
            fns[str(variant)] = lambda variant=variant: lab.gemm(a, b, torch.bfloat16, variant)
        replays = {}
        for label, fn in fns.items():
            try:
                replays[label] = graphed(fn)
            except Exception as error:  # noqa: BLE001
                print(f"not timed: {name} {(n, k)} m={m} {label}: {str(error).splitlines()[0][:80]}", flush=True)
        us = {label: t * 1e3 / CALLS for label, t in alternate(replays, rounds=2, warmup=1, reps=3).items()}
        bf16 = us["bf16 F.linear"]
        for label, t in sorted(us.items(), key=lambda item: item[1]):
            rows.append([name, f"{n}x{k}", m, label, f"{t:.1f}", f"{bf16 / t:.2f}"])
        print(rows[-len(us):], flush=True)
    print(tabulate(rows, headers=["format", "N x K", "M", "kernel", "us", "x bf16"]))


if __name__ == "__main__":
    main()
