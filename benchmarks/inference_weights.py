"""Microseconds per call of one compiled nn.Linear under torch.no_grad, at decode row counts.

    python benchmarks/inference_weights.py [--device cpu|cuda] [--shapes 1024x1024,...] [--rows 1,16]

Inference quantizes each weight from its value at the call (README, "Behaviour worth knowing"),
so a decode step pays one weight quantize per linear where a kept quantized copy would pay a
freshness check. Each row times one call of the compiled linear and, beside it, the plain
F.linear on the same operands; run it on two trees to compare them (NOTES.md says what the
check it replaced cost). On the CPU the weight quantize is the reference numerics in torch ops, far slower than the CUDA kernels:
compare rows of one device only.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tabulate import tabulate

import graphquant
from graphquant import recipes, zoo

RECIPES = {
    "tensorwise": lambda: zoo.recipe("tensorwise"),
    "mxfp8": recipes.mxfp8_block_scaling,
    "nvfp4": recipes.nvfp4_block_scaling,
}


def call_us(fn, device: torch.device, calls: int) -> float:
    """Median over 5 samples of the microseconds per call, the device drained around each sample."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    samples = []
    for _ in range(5):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", default=None, help="weights as OUTxIN, comma-separated")
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--calls", type=int, default=None, help="calls per sample")
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    shapes = args.shapes or ("4096x4096,14336x4096" if cuda else "512x512,2048x2048")
    calls = args.calls or (50 if cuda else 10)
    dtype = torch.bfloat16 if cuda else torch.float32
    backend = "inductor" if cuda else "aot_eager"
    table = []
    for shape in shapes.split(","):
        n, k = (int(d) for d in shape.split("x"))
        for name, recipe in RECIPES.items():
            torch._dynamo.reset()
            linear = torch.nn.Linear(k, n, bias=False, device=device, dtype=dtype)
            compiled = graphquant.compile(linear, recipe(), backend=backend)
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, k, device=device, dtype=dtype)
                with torch.no_grad():
                    quantized = call_us(lambda: compiled(x), device, calls)
                    plain = call_us(lambda: torch.nn.functional.linear(x, linear.weight), device, calls)
                table.append([name, f"{n}x{k}", rows, f"{quantized:.1f}", f"{plain:.1f}"])
    print(f"{device.type}, {dtype}, backend {backend}, torch {torch.__version__}")
    print(tabulate(table, headers=["recipe", "weight", "rows", "us/call graphquant", "us/call F.linear"]))


if __name__ == "__main__":
    main()
