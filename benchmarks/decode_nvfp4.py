"""NVFP4 and MXFP8 decode GEMM tilings (CANDIDATES, the library's DecodeConfig) timed beside bf16
F.linear and the library's default at a Llama-3-8B FFN's weights, and the emulated GEMM (the
weight dequantized on every call, then bf16).

    python benchmarks/decode_nvfp4.py [--rows 1,16] [--weights 14336x4096,...] [--jobs 5] [--budget 120]

Every tiling is first compiled and run once per case in one of --jobs processes, its product
checked against the float64 product of the dequantized operands (decode_tune.py's bound, on its
checked rows); one still compiling at half the budget is dropped; one that fails is reported and the
others go on. Then this process times those that passed, each
as CUDA graphs of decode_gemm.CALLS calls, and prints one table: microseconds and speedup over
bf16.
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
from common import alternate  # noqa: E402
from decode_gemm import CALLS, WEIGHTS, graphed  # noqa: E402
from decode_tune import excess, operands  # noqa: E402

from graphquant.kernels import backends, triton_decode  # noqa: E402

C = triton_decode.DecodeConfig
# (format, rows of A, tiling of the library's decode GEMM). Each is compiled once (one worker) and
# run on every weight at those rows.
CANDIDATES = [
    # the one-row FMA program's depth of copies ahead, width and K split, beside the library's
    # default (64x512, 4 warps, 1 stage, 8 an SM, of which its 120 registers let 4 run at once;
    # with 8 warps it takes 64 registers, 4 programs an SM too)
    *(("nvfp4", (1,), C(n, k, 1, w, s, t, fma=True)) for n, k, w, s, t in (
        (64, 256, 4, 1, 8), (64, 256, 4, 2, 8), (64, 512, 4, 1, 4), (64, 512, 8, 1, 4), (64, 512, 8, 1, 8), (128, 256, 4, 1, 4),
        (128, 256, 8, 1, 8),
    )),
    ("nvfp4", (1, 16), C(64, 256, 16, 4, 3, 8, a_first=True, one_dot=True)),
    ("nvfp4", (16,), C(128, 256, 16, 8, 3, 4)),
    ("mxfp8", (1,), C(64, 256, 1, 4, 3, 4, fma=True)),
    ("mxfp8", (1, 16), C(64, 256, 16, 4, 3, 8, a_first=True, one_dot=True)),
    ("mxfp8", (16,), C(128, 256, 16, 8, 3, 4)),
    ("mxfp8", (16,), C(64, 128, 16, 4, 4, 8)),
    # middle rows and prefill: tiles of 64 to 256 of A's rows against weight tiles of 64 to 256
    # rows; A decoded by every program, or first by its own kernel (a_first), in pairs or for one
    # dot a step (the default at 128 rows and more: 128x128, 128 rows, 8 warps, a_first, one_dot)
    *((name, (128,), spec) for name in ("nvfp4", "mxfp8") for spec in (C(64, 128, 64, 4, 4, 4), C(64, 128, 64, 4, 4, 4, a_first=True, one_dot=True))),
    *((name, (128, 2048), spec) for name in ("nvfp4", "mxfp8") for spec in (
        C(128, 128, 128, 8, 3, 2), C(128, 128, 128, 8, 3, 2, a_first=True), C(128, 256, 128, 8, 3, 2, a_first=True, one_dot=True),
        C(128, 64, 128, 8, 4, 2, a_first=True, one_dot=True), C(64, 128, 128, 4, 3, 2, a_first=True, one_dot=True),
    )),
    *((name, (2048,), C(128, 128, 256, 8, 3, 1, a_first=True, one_dot=True)) for name in ("nvfp4", "mxfp8")),
]


def label(spec) -> str:
    return (
        f"{'fma' if spec.fma else 'tc'} n{spec.block_n} k{spec.block_k} m{spec.block_m} w{spec.warps} s{spec.stages} "
        f"t{spec.tiles_per_sm}{' a first' if spec.a_first else ''}{' one dot' if spec.one_dot else ''}"
    )


def run(name: str, spec, a, b) -> torch.Tensor:
    if spec is None:
        return triton_decode.gemm(a, b, torch.bfloat16)
    return triton_decode.gemm(a, b, torch.bfloat16, config=spec)


def tasks_of(cases) -> list[tuple]:
    """(format, tiling, the cases it takes): the library's default first (None), then CANDIDATES."""
    defaults = [(name, None, [case for case in cases]) for name in ("nvfp4", "mxfp8")]
    return defaults + [(name, spec, [case for case in cases if case[1] in rows]) for name, rows, spec in CANDIDATES]


def check(task) -> list[tuple]:
    """One tiling (compiled once) run on every case it takes, each with its excess over the bound."""
    name, spec, cases = task
    results = []
    for case in cases:
        (n, k), m = case
        a, b = operands(name, m, n, k)
        try:
            results.append(((name, *case), spec, excess(name, run(name, spec, a, b), a, b), ""))
        except Exception as error:  # noqa: BLE001 (a tiling that does not compile is a result)
            results.append(((name, *case), spec, None, str(error).splitlines()[0][:100]))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--weights", default=",".join(f"{n}x{k}" for n, k in WEIGHTS), help="N x K of each weight")
    parser.add_argument("--jobs", type=int, default=5)
    parser.add_argument("--budget", type=float, default=120.0, help="seconds, from the start, after which no case is timed")
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget
    weights = [tuple(int(d) for d in weight.split("x")) for weight in args.weights.split(",")]
    cases = [(weight, int(m)) for m in args.rows.split(",") for weight in weights]
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
            print(f"NOT CHECKED {task[0]} {label(task[1]) if task[1] else 'default'}: {'still compiling' if not future.done() else future.exception()}", flush=True)
    good = {}
    for case, variant, ex, error in checked:
        if ex is None or ex > 0:
            print(f"FAILED {case} {label(variant) if variant else 'default'}: {error or f'outside the bound by {ex:.3g}'}", flush=True)
        elif variant is not None:
            good.setdefault(case, []).append(variant)

    rows = []
    for name, (n, k), m in [(name, *case) for case in cases for name in ("nvfp4", "mxfp8")]:
        if time.monotonic() > deadline:
            print(f"budget spent: {name} {(n, k)} m={m} and the cases after it not timed", flush=True)
            break
        if not good.get((name, (n, k), m)):
            continue
        a, b = operands(name, m, n, k)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        fns = {
            "bf16 F.linear": lambda: F.linear(x, w),
            "emulation": lambda: backends.gemm(a, b, 1, torch.bfloat16, backends.GemmBackend(backends.EMULATION), "emulation"),
            "library default": lambda: triton_decode.gemm(a, b, torch.bfloat16),
        }
        for spec in good[(name, (n, k), m)]:
            fns[label(spec)] = lambda spec=spec: run(name, spec, a, b)
        replays = {}
        for kernel, fn in fns.items():  # not ``label``, which assigned anywhere in main would hide the function
            try:
                replays[kernel] = graphed(fn)
            except Exception as error:  # noqa: BLE001
                print(f"not timed: {name} {(n, k)} m={m} {kernel}: {str(error).splitlines()[0][:80]}", flush=True)
        us = {kernel: t * 1e3 / CALLS for kernel, t in alternate(replays, rounds=2, warmup=1, reps=3).items()}
        bf16 = us["bf16 F.linear"]
        for kernel, t in sorted(us.items(), key=lambda item: item[1]):
            rows.append([name, f"{n}x{k}", m, kernel, f"{t:.1f}", f"{bf16 / t:.2f}"])
        print(rows[-len(us):], flush=True)
    print(tabulate(rows, headers=["format", "N x K", "M", "kernel", "us", "x bf16"]))


if __name__ == "__main__":
    main()
