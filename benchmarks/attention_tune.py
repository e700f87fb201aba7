"""A sweep of the FP8 flash-attention kernels' configurations on codes quantized beforehand, beside
bf16 F.scaled_dot_product_attention on cuDNN: the forward's (triton_attention.ForwardConfig) or,
with ``--pass bwd``, the backward's (triton_attention_backward.BackwardConfig, timed with the
default forward before it, beside cuDNN's forward + backward).

    python benchmarks/attention_tune.py [--pass fwd] [--seqs 8192,16384] [--masks full,causal]
        [--block-m 64,128] [--block-n 64,128] [--warps 8] [--stages 2,3,4] [--warp-specialize 0]
        [--pv-promotion tile,none] [--qk-ahead 0,1]
        [--operand-order 0,1] [--workers 14] [--reps 3]
    python benchmarks/attention_tune.py --pass bwd [--tiles 64x64,64x128,32x128,128x64] [--warps 8]
        [--stages 2,3] [--stagger 0] [--kv-heads 32] ...

The forward's defaults leave out what the H200 already ruled out (NOTES.md: 4 warps, warp
specialization); ``--warps 4,8 --warp-specialize 0,1`` sweeps them again (96 configurations take
about 2 minutes, 24 about 40 s).

32 query heads of dim 128 over ``--kv-heads`` key/value heads (32; 8 is the decoder layer's grouped
attention), 16k tokens per call (as benchmarks/attention.py), TFLOP/s counting a causal
attention as half (and forward + backward as 3.5 forwards). ``--pv-promotion`` takes ``tile``
(PV promoted into fp32 after every key tile, or every 128 keys of a wider one: the default's
numerics), a number of keys, or
``none`` (the tensor cores' accumulator carries O across the key loop: outside the error bound
tests/test_triton_attention.py checks). Every configuration is compiled first, causal and not,
in ``--workers`` processes (a process compiles one kernel at a time); the timed launches load
them from Triton's on-disk cache. One that does not compile or launch says why. Prints each
configuration's TFLOP/s per case as it is timed, then the best per case beside the kernel's
default and cuDNN.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import multiprocessing
import sys
import time

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from attention import HEAD_DIM, HEADS, TOKENS, flash_codes, flash_kernels_alone, flops  # noqa: E402
from common import time_ms  # noqa: E402

from graphquant.kernels import triton_attention, triton_attention_backward  # noqa: E402
from graphquant.kernels.triton_attention import ForwardConfig  # noqa: E402
from graphquant.kernels.triton_attention_backward import BackwardConfig  # noqa: E402

SOFTMAX_SCALE = 1 / HEAD_DIM**0.5


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _tiles(text: str) -> list[tuple[int, int]]:
    return [tuple(map(int, tile.split("x"))) for tile in text.split(",")]


def forward_configs(args) -> list[ForwardConfig]:
    """The forward grid's configurations (a promotion wider than the key tile or 128 left out)."""
    grid = []
    for block_m, block_n, warps, stages, specialize, promotion, ahead, order in itertools.product(
        _ints(args.block_m), _ints(args.block_n), _ints(args.warps), _ints(args.stages), _ints(args.warp_specialize),
        args.pv_promotion.split(","), _ints(args.qk_ahead), _ints(args.operand_order),
    ):
        keys = {"tile": min(block_n, 128), "none": None}[promotion] if promotion in ("tile", "none") else int(promotion)
        if keys is None or keys <= min(block_n, 128):
            grid.append(ForwardConfig(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages,
                                      warp_specialize=bool(specialize), pv_promotion=keys, qk_ahead=bool(ahead),
                                      operand_order=bool(order)))
    return grid


def backward_configs(args) -> list[BackwardConfig]:
    """The backward grid's configurations: (query rows, keys) of the program's tiles."""
    return [
        BackwardConfig(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages, stagger=bool(stagger))
        for (block_m, block_n), warps, stages, stagger in itertools.product(
            _tiles(args.tiles), _ints(args.warps), _ints(args.stages), _ints(args.stagger)
        )
    ]


def _inputs(seq: int, batch: int, kv_heads: int) -> list[torch.Tensor]:
    """q, k, v and dO: 32 query heads over ``kv_heads`` key/value heads."""
    return [torch.randn(batch, heads, seq, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for heads in (HEADS, kv_heads, kv_heads, HEADS)]


def _runner(inputs: list[torch.Tensor], causal: bool, config):
    """A call of the kernel(s) ``config`` configures on ``inputs`` (q, k, v, dO)."""
    q, k, v, grad = inputs
    if isinstance(config, BackwardConfig):
        return flash_kernels_alone(q, k, v, grad, causal, config)
    codes = flash_codes(q, k, v)
    return lambda: triton_attention.forward(*codes, SOFTMAX_SCALE, causal, torch.bfloat16, config=config)


def _compile(config, kv_heads: int) -> str:
    """Compile ``config``'s kernels, causal and not, into Triton's on-disk cache at the sweep's
    specialisation (a short sequence specialises as the long ones, all multiples of 16); '' or
    why it failed."""
    try:
        inputs = _inputs(128, 1, kv_heads)
        for causal in (False, True):
            _runner(inputs, causal, config)()
        torch.cuda.synchronize()
        return ""
    except Exception as error:  # noqa: BLE001 (a configuration Triton cannot build is a result)
        lines = str(error).strip().splitlines()
        return f"{type(error).__name__}: {lines[-1][:80] if lines else ''}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pass", dest="which", choices=("fwd", "bwd"), default="fwd", help="the kernel to tune")
    parser.add_argument("--seqs", default="8192,16384")
    parser.add_argument("--masks", default="full,causal")
    parser.add_argument("--block-m", default="64,128")
    parser.add_argument("--block-n", default="64,128")
    parser.add_argument("--warps", default="8")
    parser.add_argument("--stages", default=None, help="forward 2,3,4; backward 2,3")
    parser.add_argument("--warp-specialize", default="0")
    parser.add_argument("--pv-promotion", default="tile,none", help="tile, none or a number of keys, comma-separated")
    parser.add_argument("--qk-ahead", default="0", help="the forward's qk_ahead, 0 and/or 1")
    parser.add_argument("--operand-order", default="0", help="the forward's operand_order, 0 and/or 1")
    parser.add_argument("--tiles", default="64x64,64x128,32x128,128x64", help="the backward's tiles, query rows x keys")
    parser.add_argument("--stagger", default="0", help="the backward's stagger, 0 and/or 1")
    parser.add_argument("--kv-heads", type=int, default=HEADS, help="key/value heads of the 32 query heads (8: the decoder's)")
    parser.add_argument("--workers", type=int, default=14, help="processes compiling the configurations")
    parser.add_argument("--reps", type=int, default=3, help="timed samples per configuration and case")
    args = parser.parse_args()
    backward = args.which == "bwd"
    args.stages = args.stages or ("2,3" if backward else "2,3,4")
    grid = backward_configs(args) if backward else forward_configs(args)

    def default(causal: bool):
        return triton_attention_backward.DEFAULT_CONFIG if backward else triton_attention.default_config(causal)

    for config in (default(False), default(True)):
        if config not in grid:
            grid.append(config)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, f"{len(grid)} {args.which} configurations", flush=True)

    started = time.time()
    with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
        failures = dict(zip(grid, pool.map(functools.partial(_compile, kv_heads=args.kv_heads), grid, chunksize=1)))
    print(f"compiled in {time.time() - started:.0f} s, {sum(map(bool, failures.values()))} failed", flush=True)

    cases = [(int(seq), mask) for seq in args.seqs.split(",") for mask in args.masks.split(",")]
    inputs = {seq: _inputs(seq, max(1, TOKENS // seq), args.kv_heads) for seq in dict.fromkeys(seq for seq, _ in cases)}

    def tflops(case, ms):
        return flops(case[0], case[1] == "causal", backward) / ms / 1e9

    def cudnn(case):
        q, k, v, grad = inputs[case[0]]
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            if not backward:
                return F.scaled_dot_product_attention(q, k, v, is_causal=case[1] == "causal", enable_gqa=args.kv_heads != HEADS)
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = F.scaled_dot_product_attention(*leaves, is_causal=case[1] == "causal", enable_gqa=args.kv_heads != HEADS)
            torch.autograd.grad(out, leaves, grad)

    cudnn_ms = {case: time_ms(lambda: cudnn(case), warmup=2, reps=args.reps, inner=3) for case in cases}
    fields = [f.name for f in dataclasses.fields(grid[0])]
    headers = [*fields, *(f"{seq} {mask}" for seq, mask in cases)]
    print(" ".join(headers), flush=True)
    times = {}  # (config, case) -> ms
    rows = []
    for config in grid:
        row = [getattr(config, name) for name in fields]
        for case in cases:
            if failures[config]:
                row.append(failures[config])
                continue
            try:
                times[config, case] = time_ms(_runner(inputs[case[0]], case[1] == "causal", config), warmup=1, reps=args.reps, inner=2)
                row.append(f"{tflops(case, times[config, case]):.0f}")
            except Exception as error:  # noqa: BLE001
                row.append(f"{type(error).__name__}: {str(error).strip()[:80]}")
        print(" ".join(map(str, row)), flush=True)
        rows.append(row)
    for case in cases:  # cuDNN again after the sweep: the better of the two, as the GPU warmed
        cudnn_ms[case] = min(cudnn_ms[case], time_ms(lambda: cudnn(case), warmup=1, reps=args.reps, inner=3))
    print(f"timed in {time.time() - started:.0f} s in all\n")
    print(tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True))

    best = []
    for case in cases:
        timed = {config: ms for (config, c), ms in times.items() if c == case}
        choices = [("best", min(timed, key=timed.get, default=None))]
        if not backward:
            per_tile = [config for config in timed if config.pv_promotion == min(config.block_n, 128)]
            choices.append(("best promoted per tile", min(per_tile, key=timed.get, default=None)))
        for label, config in (*choices, ("default", default(case[1] == "causal"))):
            if config in timed:
                best.append([*case, label, repr(config), f"{timed[config]:.2f}", f"{tflops(case, timed[config]):.0f}",
                             f"{cudnn_ms[case] / timed[config]:.2f}x"])
        best.append([*case, "bf16 sdpa cudnn", "", f"{cudnn_ms[case]:.2f}", f"{tflops(case, cudnn_ms[case]):.0f}", "1.00x"])
    print()
    print(tabulate(best, headers=["seq", "mask", "", "config", "ms", "TFLOP/s", "vs cudnn"], tablefmt="simple", disable_numparse=True))


if __name__ == "__main__":
    main()
