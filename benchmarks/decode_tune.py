"""The decode GEMM's tilings (graphquant.kernels.triton_decode.DecodeConfig) timed at a Llama-3-8B
FFN's weights and 1 to 256 rows, beside bf16 F.linear and the emulated GEMM (the weight
dequantized to bf16 on every call, then a bf16 GEMM: what MXFP8 and NVFP4 run past the decode
GEMM's rows).

    python benchmarks/decode_tune.py [--formats mxfp8,nvfp4,fp8] [--rows 1,4,16,64,128,256] [--jobs 5] [--budget 130]

Every tiling is first run once per case in one of --jobs processes (one process a tile shape, so
that Triton compiles each kernel once, in parallel, into its cache on disk), and its product is
checked against the float64 product of the dequantized operands (tests/test_triton_decode.py's
bound); then this process times every case,
each as CUDA graphs of decode_gemm.CALLS calls (host overhead not counted), and prints the best
tiling per case, the default's time, and every tiling's; past --budget seconds it times no more
cases and prints what it has. The weight's rows span 2^0 to 2^-15, so
that its block scales reach the formats' smallest (subnormal fp16 values in NVFP4's products).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import itertools
import multiprocessing
import sys
import time

import torch
import torch.nn.functional as F
from tabulate import tabulate

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import alternate  # noqa: E402
from decode_gemm import CALLS, WEIGHTS, graphed  # noqa: E402

from graphquant.formats import fp8  # noqa: E402
from graphquant.kernels import backends, triton_decode  # noqa: E402
from graphquant.kernels.backends import EMULATION, GemmBackend  # noqa: E402
from graphquant.kernels.triton_decode import DecodeConfig  # noqa: E402
from graphquant.quantizers import (  # noqa: E402
    ROWWISE,
    Float8CurrentScalingQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    gemm_dims,
)

# (activation's quantizer, weight's) as the recipes' frozen weights have them.
FORMATS = {
    "mxfp8": (MXFP8Quantizer(), MXFP8Quantizer()),
    "nvfp4": (NVFP4Quantizer(), NVFP4Quantizer(with_2d_quantization=True)),
    "fp8": (Float8CurrentScalingQuantizer("e4m3"), Float8CurrentScalingQuantizer("e4m3")),
}
ROWS = [1, 4, 16, 64, 128, 256]
# (BLOCK_N, BLOCK_K, warps, stages) of the weight's tile on the tensor cores (TILES, NARROW_TILES)
# and on the FMA units (FMA_TILES, one row of A a program).
TILES = [(64, 128, 4, 4), (64, 256, 4, 3), (64, 512, 4, 2), (128, 128, 4, 3), (128, 256, 8, 3)]
# Tiles of 32 weight rows (too few for a warpgroup's MMA: Triton's Ampere-style MMA instead), tried
# for 16 rows of A or fewer.
NARROW_TILES = [(32, 256, 4, 3), (32, 512, 4, 2)]
FMA_TILES = [(64, 512, 4, 2), (32, 512, 4, 2), (64, 256, 4, 2), (128, 256, 8, 2)]
# The FMA kernel (one row of A a program) is tried up to this many rows.
FMA_ROWS = 4
TILES_PER_SM = [2, 3, 4, 6, 8, 16]
U = 2.0**-24
DEVICE = "cuda"  # where the operands are made (a smoke test of the checks may run them elsewhere)


def configs(name: str, m: int) -> list[DecodeConfig]:
    """The tilings tried for ``m`` rows of format ``name``: tiles of A's rows from one that holds
    them all (at most 128) down to 16 rows; FP8 codes only at 16 rows or fewer (its limit)."""
    if name == "fp8" and m > triton_decode.ONE_TILE_ROWS:
        return []
    fits = min(max(16, 1 << (m - 1).bit_length()), 128)
    block_ms = sorted({fits, max(16, fits // 2)})
    variants = {"mxfp8": [{"mx_products": p} for p in triton_decode.MX_PRODUCTS]}
    tiles_per_sm = TILES_PER_SM if m <= 16 else TILES_PER_SM[:-1]
    on_tensor_cores = [
        DecodeConfig(block_n, block_k, block_m, warps if block_m < 128 else 8, stages, tiles, **variant)
        for (block_n, block_k, warps, stages), block_m, tiles, variant in itertools.product(
            TILES + (NARROW_TILES if m <= 16 else []), block_ms, tiles_per_sm, variants.get(name, [{}])
        )
    ]
    if name == "fp8" or m > FMA_ROWS:
        return on_tensor_cores
    return on_tensor_cores + [
        DecodeConfig(block_n, block_k, 1, warps, stages, tiles, fma=True)
        for (block_n, block_k, warps, stages), tiles in itertools.product(FMA_TILES, tiles_per_sm)
    ]


@functools.lru_cache(maxsize=None)
def operands(name: str, m: int, n: int, k: int):
    """The activation's and the weight's representations, the weight's rows 2^0 to 2^-15 apart."""
    qa, qb = FORMATS[name]
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(m, k, device=DEVICE, generator=generator)
    rows_scale = torch.exp2(-(torch.arange(n, device=DEVICE) % 16).float())[:, None]
    w = (torch.randn(n, k, device=DEVICE, generator=generator) * rows_scale / 64).to(torch.bfloat16)
    return qa(x, columnwise=False).get(ROWWISE), qb(w, columnwise=False).get(ROWWISE)


# The rows of A a product is checked on: its first and last 128 (the first and last tiles of rows,
# partial or not), so that a check of thousands of rows costs no more than one of 256.
CHECKED_ROWS = 128


def checked_rows(m: int) -> torch.Tensor:
    first = min(m, CHECKED_ROWS)
    return torch.cat((torch.arange(first), torch.arange(max(first, m - CHECKED_ROWS), m))).to(DEVICE)


@functools.lru_cache(maxsize=None)
def bounds(name: str, m: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 product of the case's dequantized operands on the checked rows of A
    (checked_rows), and the decode GEMM's bound on a bf16 out's distance from it there."""
    a, b = operands(name, m, n, k)
    left, right = a.gemm_operand(torch.float64)[checked_rows(m)], b.gemm_operand(torch.float64)
    ref = left @ right.t()
    accumulation = fp8.accumulation_bound(left, right.t(), fp8.PROMOTED_PRODUCTS if name == "fp8" else fp8.FP32)
    return ref, accumulation + 4 * U * (left.abs() @ right.abs().t()) + ref.abs() * (U + 2.0**-8)


def excess(name: str, out: torch.Tensor, a, b) -> float:
    """How far a bf16 ``out`` of the case's operands ``a``, ``b`` exceeds the decode GEMM's bound
    on the checked rows (<= 0: within it)."""
    m, n, k = gemm_dims(a, b)
    ref, bound = bounds(name, m, n, k)
    return ((out[checked_rows(m)].double() - ref).abs() - bound).max().item()


def shape_of(config: DecodeConfig) -> DecodeConfig:
    """What of a tiling makes a kernel of its own (all but the programs an SM)."""
    return dataclasses.replace(config, tiles_per_sm=1)


def check(task) -> list[tuple]:
    """Every case's tilings of one format and tile shape run once (compiled), each with its excess."""
    shape, cases = task
    results = []
    for case in cases:
        name, (n, k), m = case
        a, b = operands(name, m, n, k)
        for config in configs(name, m):
            if shape_of(config) != shape:
                continue
            try:
                results.append((case, config, excess(name, triton_decode.gemm(a, b, torch.bfloat16, config=config), a, b), ""))
            except Exception as error:  # noqa: BLE001 (a tiling that does not compile is a result)
                results.append((case, config, None, str(error).splitlines()[0][:80]))
    return results


def short(config: DecodeConfig) -> str:
    return (
        f"n{config.block_n} k{config.block_k} m{config.block_m} w{config.warps} s{config.stages} "
        f"t{config.tiles_per_sm} {'fma' if config.fma else config.mx_products}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--jobs", type=int, default=5)
    parser.add_argument("--budget", type=float, default=130.0, help="seconds, from the start, after which no case is timed")
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget
    rows = [int(r) for r in args.rows.split(",")]
    cases = [(name, weight, m) for m in rows for name in args.formats.split(",") for weight in WEIGHTS if configs(name, m)]
    tasks = {}
    for case in cases:
        for config in configs(case[0], case[2]):
            tasks.setdefault((case[0], shape_of(config)), []).append(case)
    tasks = [(shape, list(dict.fromkeys(of))) for (_, shape), of in tasks.items()]
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(check, task) for task in tasks]
        # Half the budget at most: the tile shapes not started by then are not tried.
        _, late = concurrent.futures.wait(futures, timeout=args.budget / 2)
        cancelled = sum(future.cancel() for future in late)
    checked = [result for future in futures if not future.cancelled() for result in future.result()]
    print(f"{len(tasks) - cancelled}/{len(tasks)} tile shapes checked at {time.monotonic() - deadline + args.budget:.0f} s", flush=True)
    failed = [(case, config, error) for case, config, ex, error in checked if ex is None or ex > 0]
    for case, config, error in failed:
        print(f"FAILED {case} {short(config)}: {error or 'outside the bound'}", flush=True)
    good = {}
    for case, config, ex, _ in checked:
        if ex is not None and ex <= 0:
            good.setdefault(case, []).append(config)

    every, best = [], []
    for name, (n, k), m in cases:
        case = (name, (n, k), m)
        if time.monotonic() > deadline:
            print(f"budget spent: {case} and the cases after it not timed", flush=True)
            break
        a, b = operands(name, m, n, k)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        emulation = GemmBackend(EMULATION)
        fns = {
            "bf16 F.linear": lambda: F.linear(x, w),
            "emulation": lambda: backends.gemm(a, b, 1, torch.bfloat16, emulation, "tune"),
            "default": lambda: triton_decode.gemm(a, b, torch.bfloat16),
        }
        for config in good.get(case, []):
            fns[short(config)] = lambda config=config: triton_decode.gemm(a, b, torch.bfloat16, config=config)
        replays = {}
        for label, fn in fns.items():
            try:
                replays[label] = graphed(fn)
            except Exception as error:  # noqa: BLE001 (one that cannot be captured is left out, said)
                print(f"not timed: {case} {label}: {str(error).splitlines()[0][:80]}", flush=True)
        times = alternate(replays, rounds=2, warmup=1, reps=3)
        us = {label: t * 1e3 / CALLS for label, t in times.items()}
        bf16, emulated = us.pop("bf16 F.linear", float("nan")), us.pop("emulation", float("nan"))
        if "default" not in us:
            continue
        for label, t in us.items():
            every.append([name, f"{n}x{k}", m, label, f"{t:.1f}", f"{bf16 / t:.2f}", f"{emulated / t:.2f}"])
        tuned = min((label for label in us if label != "default"), key=us.get, default="default")
        best.append([
            name, f"{n}x{k}", m, f"{bf16:.1f}", f"{emulated:.1f} ({bf16 / emulated:.2f})",
            f"{us['default']:.1f} ({bf16 / us['default']:.2f})", f"{us[tuned]:.1f} ({bf16 / us[tuned]:.2f})", tuned,
        ])
        print(best[-1], flush=True)
    headers = ["format", "N x K", "M", "bf16 us", "emulation us (x bf16)", "default us (x bf16)", "best us (x bf16)", "best tiling"]
    print(tabulate(best, headers=headers))
    print()
    print(tabulate(every, headers=["format", "N x K", "M", "tiling", "us", "x bf16", "x emulation"]))
    print(f"\n{len(failed)} tilings failed or fell outside the bound")


if __name__ == "__main__":
    main()
