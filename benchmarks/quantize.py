"""Native quantize kernels against a device-to-device copy, on bf16 LLM-sized inputs.

    python benchmarks/quantize.py [--shapes 16384x4096,16384x14336] [--reps 20]
    python benchmarks/quantize.py --small [--shapes 1x4096,16x4096,1x14336,16x14336] [--reps 20] [--rounds 20]

Per format and direction: time per call, GB/s counting every byte read and written (a pre-pass
that reads x for an amax counts its read), and that bandwidth as a % of a copy of x measured in
the same run. Then each fused hybrid against its two single-direction kernels back to back
(plus the dequantize between them for a rowwise_dequantized source), and the byte bound: the
speedup the fused pass would have at the two kernels' bandwidth (the ratio of bytes moved).

With --small: decode activations' rowwise quantizes, the small rowwise program's one launch
beside the tile programs' launches (small()).

Calls are captured in a CUDA graph and replayed, so the times are the GPU's, not Python's.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Callable

import torch
from tabulate import tabulate

from graphquant.kernels import native
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

FORMATS = {
    "fp8 current (e4m3)": lambda: Float8CurrentScalingQuantizer(),
    "fp8 delayed (e4m3)": lambda: Float8DelayedScalingQuantizer(),
    "fp8 block 1x128": lambda: Float8BlockQuantizer(block_scaling_dim=1),
    "fp8 block 128x128": lambda: Float8BlockQuantizer(block_scaling_dim=2),
    "fp8 rowwise": lambda: Float8RowwiseQuantizer(),
    "mxfp8 (e4m3)": lambda: MXFP8Quantizer(),
    "nvfp4 1x16": lambda: NVFP4Quantizer(),
    "nvfp4 16x16": lambda: NVFP4Quantizer(with_2d_quantization=True),
    "nvfp4 sr": lambda: NVFP4Quantizer(stochastic_rounding=True),
    "nvfp4 rht+sr": lambda: NVFP4Quantizer(with_rht=True, with_post_rht_amax=True, stochastic_rounding=True),
}
HYBRIDS = {
    "mxfp8 -> fp8 block 1x128": lambda: HybridQuantizer(MXFP8Quantizer(), Float8BlockQuantizer(block_scaling_dim=1)),
    "fp8 block 1x128 -> mxfp8": lambda: HybridQuantizer(Float8BlockQuantizer(block_scaling_dim=1), MXFP8Quantizer()),
    "fp8 current -> mxfp8": lambda: HybridQuantizer(Float8CurrentScalingQuantizer(), MXFP8Quantizer()),
    "mxfp8 -> nvfp4 sr": lambda: HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(stochastic_rounding=True)),
    "mxfp8 -> nvfp4 rht+sr": lambda: HybridQuantizer(
        MXFP8Quantizer(), NVFP4Quantizer(with_rht=True, with_post_rht_amax=True, stochastic_rounding=True)
    ),
    "mxfp8 -> nvfp4 (dequantized)": lambda: HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(), "rowwise_dequantized"),
    "nvfp4 -> mxfp8 (dequantized)": lambda: HybridQuantizer(NVFP4Quantizer(), MXFP8Quantizer(), "rowwise_dequantized"),
    "nvfp4 row-scaled -> mxfp8 (dequantized)": lambda: HybridQuantizer(
        NVFP4Quantizer(row_scaled_nvfp4=True), MXFP8Quantizer(), "rowwise_dequantized"
    ),
}


def captured(fn: Callable[[], object], reps: int) -> torch.cuda.CUDAGraph:
    """``reps`` calls of ``fn`` captured in one CUDA graph, replayed once."""
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
    return graph


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    """ms per call of one replay of ``graph``, ``reps`` calls."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def gpu_ms(fn: Callable[[], object], reps: int) -> float:
    """Median ms per call of ``fn``, ``reps`` calls captured in one CUDA graph, over 5 replays."""
    graph = captured(fn, reps)
    times = [replay_ms(graph, reps) for _ in range(5)]
    del graph
    return statistics.median(times)


def out_bytes(reps) -> int:
    return sum(t.numel() * t.element_size() for rep in reps if rep is not None for t in rep.tensors())


def pre_passes(quantizer) -> int:
    """Passes over x before the encode: a per-tensor (FP8 current, NVFP4's global) or per-row
    amax is taken first."""
    return int(isinstance(quantizer, (Float8CurrentScalingQuantizer, Float8RowwiseQuantizer, NVFP4Quantizer)))


def hybrid_bytes(hybrid, x, rowwise, columnwise) -> tuple[int, int]:
    """Bytes read and written by the two single-direction kernels back to back (with the
    dequantize between them for a rowwise_dequantized source: it reads the rowwise copy and
    writes x's size, which the column kernel reads), and by the fused pass, whose amax pre-passes
    read x once for both sides (once more for a dequantized source's column amaxes)."""
    row_q, col_q = hybrid.rowwise_quantizer, hybrid.columnwise_quantizer
    out_r, out_c = out_bytes([rowwise]), out_bytes([columnwise])
    separate = (1 + pre_passes(row_q)) * x.nbytes + out_r + (1 + pre_passes(col_q)) * x.nbytes + out_c
    if hybrid.columnwise_source == "rowwise_dequantized":
        separate += out_r + x.nbytes
        fused_passes = 1 + pre_passes(row_q) + pre_passes(col_q)
    else:
        fused_passes = 1 + max(pre_passes(row_q), pre_passes(col_q))
    return separate, fused_passes * x.nbytes + out_r + out_c


SMALL_SHAPES = "1x4096,16x4096,1x14336,16x14336"
SMALL_FORMATS = {
    "nvfp4 1x16": lambda: NVFP4Quantizer(),
    "nvfp4 row-scaled": lambda: NVFP4Quantizer(row_scaled_nvfp4=True),
    "mxfp8 (e4m3)": lambda: MXFP8Quantizer(),
}


def kernels_per_call(fn: Callable[[], object]) -> int:
    """The kernels one call of ``fn`` launches, as the profiler sees them."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        fn()
        torch.cuda.synchronize()
    return sum(event.device_type == torch.autograd.DeviceType.CUDA for event in profile.events())


def small(shapes: str, reps: int, rounds: int) -> None:
    """Rowwise quantizes of decode activations: the tile programs' launches beside the small
    rowwise program's one (csrc/cuda/small_rowwise.cuh), each captured as a CUDA graph of ``reps``
    calls, the two replayed in alternating rounds (median per call)."""
    ext = native.extension()
    ctx = QuantizeContext()
    rows = []
    for shape in shapes.split(","):
        m, k = (int(v) for v in shape.split("x"))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        for name, factory in SMALL_FORMATS.items():
            q = factory()

            def call():
                return native.quantize(q, x, ROWWISE, ctx)

            graphs, kernels = {}, {}
            for on in (False, True):
                ext.set_small_rowwise(on)
                kernels[on], graphs[on] = kernels_per_call(call), captured(call, reps)
            ext.set_small_rowwise(True)
            times = {False: [], True: []}
            for _ in range(rounds):
                for on in (False, True):
                    times[on].append(replay_ms(graphs[on], reps))
            old, new = (statistics.median(times[on]) * 1e3 for on in (False, True))
            rows.append([f"{m}x{k}", name, kernels[False], kernels[True], f"{old:.2f}", f"{new:.2f}", f"{old / new:.2f}x"])
            del graphs
    headers = ["shape (bf16)", "format", "kernels, tile programs", "kernels, small", "tile programs (us)", "small (us)", "speedup"]
    print(tabulate(rows, headers=headers, tablefmt="github"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", help="MxK,... (default 16384x4096,16384x14336)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--small", action="store_true", help=f"decode activations' rowwise quantizes instead (shapes {SMALL_SHAPES} unless given)")
    parser.add_argument("--rounds", type=int, default=20, help="--small: alternating rounds of the two paths")
    args = parser.parse_args()
    if native.extension() is None:
        raise SystemExit("graphquant._C has no CUDA kernels: build it first (pip install --no-build-isolation -e .)")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if args.small:
        small(SMALL_SHAPES if args.shapes is None else args.shapes, args.reps, args.rounds)
        return
    ctx = QuantizeContext(scale=torch.tensor([0.5], device="cuda"), seed=1, offset=2)
    summary, bounds = [], []
    for shape in (args.shapes or "16384x4096,16384x14336").split(","):
        m, k = (int(v) for v in shape.split("x"))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        copy_out = torch.empty_like(x)
        copy_ms = gpu_ms(lambda: copy_out.copy_(x), args.reps)
        copy_gbs = 2 * x.nbytes / copy_ms / 1e6
        print(f"\n{m}x{k} bf16: device-to-device copy {copy_ms * 1e3:.1f} us, {copy_gbs:.0f} GB/s (read + write)")

        rows = []
        for name, factory in FORMATS.items():
            q = factory()
            passes = 1 + pre_passes(q)
            for direction, call in (
                (ROWWISE, lambda: (native.quantize(q, x, ROWWISE, ctx),)),
                (COLUMNWISE, lambda: (native.quantize(q, x, COLUMNWISE, ctx),)),
                ("both", lambda: native.quantize_hybrid(q, x, ctx)),
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
                rowwise = native.quantize(row_q, x, ROWWISE, ctx)
                source = native.dequantize(rowwise) if dequantized else x
                return rowwise, native.quantize(col_q, source, COLUMNWISE, ctx)

            fused_ms = gpu_ms(lambda: native.quantize_hybrid(q, x, ctx), args.reps)
            separate_ms = gpu_ms(separate, args.reps)
            separate_bytes, fused_bytes = hybrid_bytes(q, x, *native.quantize_hybrid(q, x, ctx))
            bound = separate_bytes / fused_bytes  # the speedup at equal bandwidth
            rows.append([name, f"{fused_ms * 1e3:.1f}", f"{separate_ms * 1e3:.1f}", f"{separate_ms / fused_ms:.2f}x", f"{bound:.2f}x"])
            summary.append((f"{m}x{k} hybrid {name}", separate_ms / fused_ms))
            bounds.append(bound)
        headers = ["fused hybrid", "fused (us)", "two kernels (us)", "speedup", "byte bound"]
        print(tabulate(rows, headers=headers, tablefmt="github"))

    single = [v for n, v in summary if "hybrid" not in n]
    hybrid = [v for n, v in summary if "hybrid" in n]
    print(f"\nsingle-pass formats: {min(single):.0f}% to {max(single):.0f}% of copy bandwidth (target >= 80%)")
    print(
        f"fused hybrid: {min(hybrid):.2f}x to {max(hybrid):.2f}x faster than two kernels (target >= 1.5x; "
        f"byte bounds {min(bounds):.2f}x to {max(bounds):.2f}x)"
    )


if __name__ == "__main__":
    main()
