"""Where a decode step's host time goes: the sweep's FFN (two Llama-3-8B SwiGLU blocks, or with
``--model moe`` its MoE layer) under torch.no_grad() at a few rows, compiled five ways,
microseconds per call.

    python benchmarks/decode_host.py [--tiny] [--model ffn|moe] [--rows 1] [--configs NAME,...] [--calls 200]
                                     [--profile NAME,...] [--profile-trees NAME,...] [--trace-trees NAME,...]

- "eager launches": torch.compile's default mode; every kernel is launched from Python at every
  call, so the host's column is Dynamo's guards, Inductor's wrapper and every launch (graphquant's
  decode GEMM through its custom op and Triton).
- "no compute": the same model compiled by an inner backend whose graph hands back its first
  call's outputs: the host's path to the graph and nothing else (Dynamo's guards, AOT's runtime
  wrapper, whatever graphquant adds), host only, on the CPU as on CUDA.
- "graph trees": mode="reduce-overhead", what inference_sweep.py --cudagraphs times: the host's
  column is Dynamo's guards, AOT's wrapper and the tree's Python around one replay.
- "no trees": mode="reduce-overhead" compiled with torch._inductor.config.triton.cudagraph_trees
  off, so that Inductor wraps each graph in its plain CUDA graph (static inputs checked by
  address, the others copied in, one replay): the gap to "graph trees" is the tree's own Python.
- "one graph" (CUDA): the eager-launch model captured whole by torch.cuda.graph and replayed by
  hand, the least host work a call can have; its GPU column is the step's GPU time.

Each cell is ``--calls`` calls issued back to back behind a queued one: "host" is their wall clock
before the GPU is waited for, "GPU" the CUDA events around them (where host < GPU the GPU set the
pace). ``--profile NAME`` prints cProfile's top functions (by own, then by cumulative time; us a
call) of that configuration's eager calls, ``--profile-trees NAME`` of its graph-tree calls (before
the table); ``--trace-trees NAME`` lists the host's torch and CUDA runtime calls in its graph-tree
calls (torch.profiler: a CUDA synchronisation a call shows there, which cProfile cannot tell from
work). ``--tiny``: the CPU with small dims and aot_eager, eager launches and no compute (with
many ``--calls``, the latter times the host's path to a graph on the CPU: NOTES.md).
"""

from __future__ import annotations

import argparse
import cProfile
import pathlib
import pstats
import sys
import time
from typing import Any, Callable

import torch
from tabulate import tabulate
from torch._dynamo.backends.common import aot_autograd

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from inference_configs import BF16, FROZEN, allow_graphs, build, inference_model  # noqa: E402

DEFAULT_CONFIGS = f"{BF16},graphquant tensorwise{FROZEN},graphquant nvfp4{FROZEN}"


def per_call_us(fn, calls: int, cuda: bool) -> tuple[float, ...]:
    """(host, GPU) microseconds per call over ``calls`` calls behind one queued ((host,) on the CPU)."""
    for _ in range(3):
        fn()
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()
        start.record()
    began = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - began) / calls * 1e6
    if not cuda:
        return (host,)
    end.record()
    torch.cuda.synchronize()
    return host, start.elapsed_time(end) / calls * 1e3


def one_graph(model: torch.nn.Module, x: torch.Tensor):
    """``model(x)`` captured whole by torch.cuda.graph (after warm calls on a side stream): its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            model(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model(x)
    return graph.replay


def no_compute(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """A torch.compile backend: AOT's forward graph, run at the first call only; each later call
    returns the first one's outputs."""

    def compiler(graph: torch.fx.GraphModule, inputs: list) -> Callable:
        outputs = []

        def run(args: list) -> Any:
            if not outputs:
                outputs.append(graph(*args))
            return outputs[0]

        run._boxed_call = True
        return run

    return aot_autograd(fw_compiler=compiler)(gm, example_inputs)


def without_trees(model: torch.nn.Module, x: torch.Tensor):
    """``model(x)`` for a model compiled with mode="reduce-overhead", its graph at ``x``'s shape
    compiled (by the first call, here) with CUDA graph trees off: Inductor then records it in a
    CUDA graph of its own, replayed with no tree around it."""
    with torch._inductor.config.patch({"triton.cudagraph_trees": False}):
        model(x)
    return lambda: model(x)


def profile(fn, calls: int, top: int = 25) -> str:
    """cProfile of ``calls`` calls of ``fn``, in microseconds a call (pstats' own print gives
    milliseconds for all the calls, too coarse for calls of tens of microseconds): the ``top``
    functions by own time, then by cumulative time."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    rows = [
        (own / calls * 1e6, cumulative / calls * 1e6, count / calls, f"{'/'.join(pathlib.Path(file).parts[-2:])}:{line}({name})")
        for (file, line, name), (_, count, own, cumulative, _) in pstats.Stats(profiler).stats.items()
    ]
    tables = [f"{sum(row[0] for row in rows):.1f} us a call under cProfile"]
    for order, key in (("own", 0), ("cumulative", 1)):
        ranked = sorted(rows, key=lambda row: row[key], reverse=True)[:top]
        tables.append(tabulate([[f"{own:.2f}", f"{cumulative:.2f}", f"{count:g}", where] for own, cumulative, count, where in ranked],
                               headers=["own us", "cumulative us", "calls", f"function, by {order} time"], disable_numparse=True))
    return "\n\n".join(tables)


def trace(fn, calls: int, top: int = 20) -> str:
    """torch.profiler's host events (torch ops and CUDA runtime calls) of ``calls`` calls of
    ``fn``, by their own host time, in microseconds a call."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = sorted(profiler.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return tabulate([[f"{e.self_cpu_time_total / calls:.2f}", f"{e.count / calls:g}", e.key[:100]] for e in events],
                    headers=["own us", "calls", "host event"], disable_numparse=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--model", choices=("ffn", "moe"), default="ffn", help="the sweep's FFN, or its MoE layer")
    parser.add_argument("--rows", default="1")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--profile", default="")
    parser.add_argument("--profile-trees", default="")
    parser.add_argument("--trace-trees", default="")
    args = parser.parse_args(argv)
    cuda = not args.tiny
    if (args.profile_trees or args.trace_trees) and not cuda:
        parser.error("--profile-trees and --trace-trees look at CUDA graph trees, which need CUDA (not --tiny)")
    device = torch.device("cuda" if cuda else "cpu")
    names = args.configs.split(",")
    rows = [int(r) for r in args.rows.split(",")]
    allow_graphs(3 * len(names) * len(rows))
    base, dim, described = inference_model(args.model, args.tiny, device)
    print(f"{described} on {device}, torch {torch.__version__}, rows {rows}, {args.calls} calls a cell", flush=True)
    lines = []
    with torch.no_grad():
        for name in names:
            example = torch.randn(rows[0], dim, device=device, dtype=torch.bfloat16)  # what a frozen MoE is called on before freeze
            eager = build(name, base, device, cudagraphs=False, example=example)
            bare = build(name, base, device, cudagraphs=False, backend=no_compute, example=example)
            trees, plain = (build(name, base, device, cudagraphs=True, example=example) for _ in range(2)) if cuda else (None, None)
            for r in rows:
                x = torch.randn(r, dim, device=device, dtype=torch.bfloat16)
                cells = [*per_call_us(lambda: eager(x), args.calls, cuda), *per_call_us(lambda: bare(x), args.calls, cuda=False)]
                if cuda:
                    cells += [*per_call_us(lambda: trees(x), args.calls, cuda), *per_call_us(without_trees(plain, x), args.calls, cuda),
                              *per_call_us(one_graph(eager, x), args.calls, cuda)]
                lines.append([name, r, *(f"{us:.1f}" for us in cells)])
                print(f"{name} @{r} rows: {', '.join(lines[-1][2:])}", flush=True)  # kept if a time limit stops the run
                if name in args.profile.split(","):
                    print(f"--- {name} @{r} rows, eager launches: cProfile of {args.calls} calls\n{profile(lambda: eager(x), args.calls)}")
                if name in args.profile_trees.split(","):
                    print(f"--- {name} @{r} rows, graph trees: cProfile of {args.calls} calls\n{profile(lambda: trees(x), args.calls)}")
                if name in args.trace_trees.split(","):
                    print(f"--- {name} @{r} rows, graph trees: host events of {args.calls} calls\n{trace(lambda: trees(x), args.calls)}")
    headers = ["config", "rows", "eager launches host", *(["GPU"] if cuda else []), "no compute host"]
    if cuda:
        headers += ["graph trees host", "GPU", "no trees host", "GPU", "one graph host", "GPU"]
    print(tabulate(lines, headers=headers, disable_numparse=True))


if __name__ == "__main__":
    main()
