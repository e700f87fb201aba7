"""Native quantize kernels against a device-to-device copy, on bf16 LLM-sized inputs.

    python benchmarks/quantize.py [--shapes 16384x4096,16384x14336] [--reps 20]

Per format and direction: time per call, GB/s counting every byte read and written (a pre-pass
that reads x for an amax counts its read), and that bandwidth as a % of a copy of x measured in
the same run. Then each fused hybrid against its two single-direction kernels back to back
(plus the dequantize between them for a rowwise_dequantized source).

Calls are captured in a CUDA graph and replayed, so the times are the GPU's, not Python's.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Callable

import torch
from tabulate import tabulate

from graphquant import kernels
from graphquant.quantizers import (
    COLUMNWISE,
    ROWWISE,
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8DelayedScalingQuantizer,
    Float8RowwiseQuantizer,
    HybridQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    QuantizeContext,
)

# name -> (factory, passes over x): formats with a per-tensor/row/column amax read x twice.
FORMATS = {
    "fp8 current (e4m3)": (lambda: Float8CurrentScalingQuantizer(), 2),
    "fp8 delayed (e4m3)": (lambda: Float8DelayedScalingQuantizer(), 1),
    "fp8 block 1x128": (lambda: Float8BlockQuantizer(block_scaling_dim=1), 1),
    "fp8 block 128x128": (lambda: Float8BlockQuantizer(block_scaling_dim=2), 1),
    "fp8 rowwise": (lambda: Float8RowwiseQuantizer(), 2),
    "mxfp8 (e4m3)": (lambda: MXFP8Quantizer(), 1),
    "nvfp4 1x16": (lambda: NVFP4Quantizer(), 2),
    "nvfp4 16x16": (lambda: NVFP4Quantizer(with_2d_quantization=True), 2),
    "nvfp4 rht+sr": (lambda: NVFP4Quantizer(with_rht=True, with_post_rht_amax=True, stochastic_rounding=True), 2),
}
HYBRIDS = {
    "mxfp8 -> fp8 block 1x128": lambda: HybridQuantizer(MXFP8Quantizer(), Float8BlockQuantizer(block_scaling_dim=1)),
    "fp8 block 1x128 -> mxfp8": lambda: HybridQuantizer(Float8BlockQuantizer(block_scaling_dim=1), MXFP8Quantizer()),
    "fp8 current -> mxfp8": lambda: HybridQuantizer(Float8CurrentScalingQuantizer(), MXFP8Quantizer()),
    "mxfp8 -> nvfp4 rht+sr": lambda: HybridQuantizer(
        MXFP8Quantizer(), NVFP4Quantizer(with_rht=True, with_post_rht_amax=True, stochastic_rounding=True)
    ),
    "nvfp4 -> mxfp8 (dequantized)": lambda: HybridQuantizer(NVFP4Quantizer(), MXFP8Quantizer(), "rowwise_dequantized"),
    "nvfp4 row-scaled -> mxfp8 (dequantized)": lambda: HybridQuantizer(
        NVFP4Quantizer(row_scaled_nvfp4=True), MXFP8Quantizer(), "rowwise_dequantized"
    ),
}


def gpu_ms(fn: Callable[[], object], reps: int) -> float:
    """Median ms per call of ``fn``, ``reps`` calls captured in one CUDA graph, over 5 replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm up outside the capture (kernel attributes, allocator pools)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps)
    del graph
    return statistics.median(times)


def out_bytes(reps) -> int:
    return sum(t.numel() * t.element_size() for rep in reps if rep is not None for t in rep.tensors())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="16384x4096,16384x14336")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    if kernels.native() is None:
        raise SystemExit("graphquant._C has no CUDA kernels: build it first (pip install --no-build-isolation -e .)")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    ctx = QuantizeContext(scale=torch.tensor([0.5], device="cuda"), seed=1, offset=2)
    summary = []
    for shape in args.shapes.split(","):
        m, k = (int(v) for v in shape.split("x"))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        copy_out = torch.empty_like(x)
        copy_ms = gpu_ms(lambda: copy_out.copy_(x), args.reps)
        copy_gbs = 2 * x.nbytes / copy_ms / 1e6
        print(f"\n{m}x{k} bf16: device-to-device copy {copy_ms * 1e3:.1f} us, {copy_gbs:.0f} GB/s (read + write)")

        rows = []
        for name, (factory, passes) in FORMATS.items():
            q = factory()
            for direction, call in (
                (ROWWISE, lambda: (kernels.quantize(q, x, ROWWISE, ctx),)),
                (COLUMNWISE, lambda: (kernels.quantize(q, x, COLUMNWISE, ctx),)),
                ("both", lambda: kernels.quantize_hybrid(q, x, ctx)),
            ):
                ms = gpu_ms(call, args.reps)
                gbs = (passes * x.nbytes + out_bytes(call())) / ms / 1e6
                rows.append([name, direction, passes, f"{ms * 1e3:.1f}", f"{gbs:.0f}", f"{100 * gbs / copy_gbs:.0f}%"])
                if passes == 1:
                    summary.append((f"{m}x{k} {name} {direction}", 100 * gbs / copy_gbs))
        print(tabulate(rows, headers=["format", "direction", "passes", "time (us)", "GB/s", "% of copy"], tablefmt="github"))

        rows = []
        for name, factory in HYBRIDS.items():
            q = factory()
            row_q, col_q = q.rowwise_quantizer, q.columnwise_quantizer
            dequantized = q.columnwise_source == "rowwise_dequantized"

            def separate():
                rowwise = kernels.quantize(row_q, x, ROWWISE, ctx)
                source = kernels.dequantize(rowwise) if dequantized else x
                return rowwise, kernels.quantize(col_q, source, COLUMNWISE, ctx)

            fused_ms = gpu_ms(lambda: kernels.quantize_hybrid(q, x, ctx), args.reps)
            separate_ms = gpu_ms(separate, args.reps)
            rows.append([name, f"{fused_ms * 1e3:.1f}", f"{separate_ms * 1e3:.1f}", f"{separate_ms / fused_ms:.2f}x"])
            summary.append((f"{m}x{k} hybrid {name}", separate_ms / fused_ms))
        print(tabulate(rows, headers=["fused hybrid", "fused (us)", "two kernels (us)", "speedup"], tablefmt="github"))

    single = [v for n, v in summary if "hybrid" not in n]
    hybrid = [v for n, v in summary if "hybrid" in n]
    print(f"\nsingle-pass formats: {min(single):.0f}% to {max(single):.0f}% of copy bandwidth (target >= 80%)")
    print(f"fused hybrid: {min(hybrid):.2f}x to {max(hybrid):.2f}x faster than two kernels (target >= 1.5x)")


if __name__ == "__main__":
    main()
