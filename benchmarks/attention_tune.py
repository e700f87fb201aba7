"""A sweep of the FP8 flash-attention forward's configurations (triton_attention.ForwardConfig)
on codes quantized beforehand, beside bf16 F.scaled_dot_product_attention on cuDNN.

    python benchmarks/attention_tune.py [--seqs 8192,16384] [--masks full,causal] [--block-m 64,128]
        [--block-n 64,128] [--warps 4,8] [--stages 2,3,4] [--warp-specialize 0,1]
        [--pv-promotion tile,none] [--workers 14] [--reps 3]

32 heads of dim 128, 16k tokens per call (as benchmarks/attention.py), TFLOP/s counting a causal
attention as half. ``--pv-promotion`` takes ``tile`` (PV promoted into fp32 after every key
tile, the default's numerics), a number of keys, or ``none`` (the tensor cores' accumulator
carries O across the key loop: faster, outside the tested error bound). Every configuration is
compiled first in ``--workers`` processes (Triton compiles one kernel at a time per process; the
launches then load them from Triton's cache); one that does not compile or launch says why.
Prints every configuration's TFLOP/s per case, then the best per case and the kernel's default.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import sys
import time

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from attention import HEAD_DIM, HEADS, TOKENS, flash_kernel_alone, flops  # noqa: E402
from common import time_ms  # noqa: E402

from graphquant.kernels.triton_attention import DEFAULT_CONFIGS, ForwardConfig  # noqa: E402


def configs(args) -> list[ForwardConfig]:
    """The grid's configurations (a promotion wider than the key tile left out)."""
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    grid = []
    for block_m, block_n, warps, stages, specialize, promotion in itertools.product(
        ints(args.block_m), ints(args.block_n), ints(args.warps), ints(args.stages), ints(args.warp_specialize),
        args.pv_promotion.split(","),
    ):
        keys = {"tile": block_n, "none": None}[promotion] if promotion in ("tile", "none") else int(promotion)
        if keys is None or keys <= block_n:
            grid.append(ForwardConfig(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages,
                                      warp_specialize=bool(specialize), pv_promotion=keys))
    return grid


def _inputs(seq: int, batch: int):
    return [torch.randn(batch, HEADS, seq, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3)]


def _compile(config: ForwardConfig) -> str:
    """Compile (into Triton's on-disk cache) the kernels of ``config``, causal and not, at the
    sweep's specialisation (lengths multiples of 16); '' or why it failed."""
    try:
        q, k, v = _inputs(128, 1)  # a short sequence specialises as the long ones do (multiples of 16)
        for causal in (False, True):
            flash_kernel_alone(q, k, v, causal, config)()
        torch.cuda.synchronize()
        return ""
    except Exception as error:  # noqa: BLE001 (a configuration Triton cannot build is a result)
        return f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:100] if str(error).strip() else ''}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", default="8192,16384")
    parser.add_argument("--masks", default="full,causal")
    parser.add_argument("--block-m", default="64,128")
    parser.add_argument("--block-n", default="64,128")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--stages", default="2,3,4")
    parser.add_argument("--warp-specialize", default="0,1")
    parser.add_argument("--pv-promotion", default="tile,none", help="tile, none or a number of keys, comma-separated")
    parser.add_argument("--workers", type=int, default=14, help="processes compiling the configurations")
    parser.add_argument("--reps", type=int, default=3, help="timed samples per configuration and case")
    args = parser.parse_args()
    grid = configs(args)
    default = DEFAULT_CONFIGS[HEAD_DIM]
    if default not in grid:
        grid.append(default)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, f"{len(grid)} configurations")

    started = time.time()
    with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
        failures = dict(zip(grid, pool.map(_compile, grid, chunksize=1)))
    print(f"compiled in {time.time() - started:.0f} s, {sum(map(bool, failures.values()))} failed")

    results = {}  # (seq, mask) -> {name: ms or why not}
    for seq in map(int, args.seqs.split(",")):
        q, k, v = _inputs(seq, max(1, TOKENS // seq))
        for mask in args.masks.split(","):
            causal = mask == "causal"
            case = results.setdefault((seq, mask), {})

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    F.scaled_dot_product_attention(q, k, v, is_causal=causal)

            case["bf16 sdpa cudnn"] = time_ms(cudnn, warmup=2, reps=args.reps, inner=3)
            for config in grid:
                if failures[config]:
                    case[config] = failures[config]
                    continue
                try:
                    case[config] = time_ms(flash_kernel_alone(q, k, v, causal, config), warmup=1, reps=args.reps, inner=2)
                except Exception as error:  # noqa: BLE001
                    case[config] = f"{type(error).__name__}: {str(error).strip()[:100]}"
            case["bf16 sdpa cudnn"] = min(case["bf16 sdpa cudnn"], time_ms(cudnn, warmup=1, reps=args.reps, inner=3))
        del q, k, v
        torch.cuda.empty_cache()
    print(f"timed in {time.time() - started:.0f} s in all")

    def tflops(seq, mask, ms):
        return flops(seq, mask == "causal", False) / ms / 1e9

    cases = list(results)
    rows = []
    for config in grid:
        row = [config.block_m, config.block_n, config.num_warps, config.num_stages, int(config.warp_specialize),
               "none" if config.pv_promotion is None else config.pv_promotion]
        for seq, mask in cases:
            ms = results[seq, mask][config]
            row.append(f"{tflops(seq, mask, ms):.0f}" if isinstance(ms, float) else ms)
        rows.append(row)
    headers = ["BM", "BN", "warps", "stages", "ws", "pv promo", *(f"{seq} {mask}" for seq, mask in cases)]
    print(tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True))

    best_rows = []
    for seq, mask in cases:
        timed = {c: ms for c, ms in results[seq, mask].items() if isinstance(ms, float) and c != "bf16 sdpa cudnn"}
        cudnn_ms = results[seq, mask]["bf16 sdpa cudnn"]
        for label, config in (("best", min(timed, key=timed.get, default=None)),
                              ("best, promoted per tile", min((c for c in timed if c.pv_promotion == c.block_n), key=timed.get, default=None)),
                              ("default", default)):
            if config in timed:
                best_rows.append([seq, mask, label, repr(config), f"{timed[config]:.2f}", f"{tflops(seq, mask, timed[config]):.0f}",
                                  f"{cudnn_ms / timed[config]:.2f}x"])
        best_rows.append([seq, mask, "bf16 sdpa cudnn", "", f"{cudnn_ms:.2f}", f"{tflops(seq, mask, cudnn_ms):.0f}", "1.00x"])
    print(tabulate(best_rows, headers=["seq", "mask", "", "config", "ms", "TFLOP/s", "vs cudnn"], tablefmt="simple", disable_numparse=True))


if __name__ == "__main__":
    main()
