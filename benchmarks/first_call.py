"""Where the first call of a compiled FFN goes: Dynamo, graphquant's passes, AOT autograd,
Inductor's lowering and code generation, kernel compiles and autotuning.

    python benchmarks/first_call.py CONFIG [--rows 16384[,2048...]] [--blocks 1] [--grad] [--tiny] [--budget S] [--top 15]

CONFIG is a configuration of inference_configs.py ("graphquant mxfp8", "graphquant mxfp8 frozen",
"bf16 torch.compile", ...). The model is ``--blocks`` FeedForward blocks of models.py, called once
at each of ``--rows`` row counts in turn under torch.no_grad() (``--grad``: a training step's
forward and backward, graphquant compiled with mode=None, for comparison) with Inductor's caches
off, so that each call compiles everything its shape needs: the first compiles the model, a later
one what a new batch size costs a server (each shape its own graph, as inference_sweep.py's "next
rows" column). Prints, for each call, its seconds, Dynamo's compile-time table (cumulative seconds
of each phase), Inductor's count of generated kernels, Dynamo's counters (graphs, recompiles,
graph breaks) and the functions that took the most time by cProfile (the main process only:
Inductor compiles kernels in worker processes, whose wait shows as async_compile.wait). Run it
in a fresh process per configuration: in-process caches would hide the next one's compiles.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import signal
import sys
import traceback

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402
from torch._dynamo.utils import compilation_time_metrics, compile_times, counters  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import seconds  # noqa: E402
from inference_configs import BF16, RECIPES, build, inference_model  # noqa: E402

import graphquant  # noqa: E402


# (path fragment, function) of the calls whose cumulative time says where a first call goes.
PHASES = [
    ("graphquant/compiler.py", "_compile"),  # graphquant's backend: its passes, then the inner compile
    ("passes/find_gemms.py", "find_gemms"),
    ("passes/plan.py", "plan"),
    ("passes/rewrite.py", "rewrite"),
    ("torch/_inductor/compile_fx.py", "compile_fx"),
    ("torch/_inductor/graph.py", "run"),
    ("torch/_inductor/scheduler.py", "codegen"),
    ("torch/_inductor/async_compile.py", "wait"),
    ("torch/_inductor/runtime/triton_heuristics.py", "precompile"),
    ("torch/_inductor/runtime/triton_heuristics.py", "benchmark_all_configs"),
    ("triton/runtime/autotuner.py", "run"),  # graphquant's own autotuned kernels (the decode GEMM)
    ("triton/compiler/compiler.py", "compile"),  # Triton compiles in this process (graphquant's own kernels)
]


def phases(stats: pstats.Stats) -> list[tuple[str, int, float]]:
    rows = []
    for fragment, function in PHASES:
        found = [(value[1], value[3]) for (path, _, name), value in stats.stats.items() if fragment in path and name == function]
        if found:
            rows.append((f"{fragment}:{function}", sum(n for n, _ in found), sum(t for _, t in found)))
    return rows


def model_for(config: str, base: torch.nn.Module, device: torch.device, grad: bool) -> torch.nn.Module:
    """``config``'s model under Inductor; with ``grad`` a graphquant recipe compiles for training (mode=None)."""
    if grad and config != BF16:
        recipe = RECIPES.get(config.removeprefix("graphquant "))
        if recipe is None:
            raise SystemExit(f"--grad trains {BF16!r} or a per-call graphquant configuration "
                             f"({', '.join(f'graphquant {name}' for name in RECIPES)}), not {config!r}")
        return graphquant.compile(base, recipe(), dynamic=False)
    return build(config, base, device, cudagraphs=False, backend="inductor")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--rows", default="16384", help="row counts, comma-separated: one call at each, in this order")
    parser.add_argument("--blocks", type=int, default=1)
    parser.add_argument("--grad", action="store_true", help="a training step's first call (forward and backward)")
    parser.add_argument("--tiny", action="store_true", help="the CPU, dims 128 and 256 (Inductor's C++ backend)")
    parser.add_argument("--budget", type=int, default=None,
                        help="seconds: if the calls are still running then, report what the current one did so far and where it is, and exit")
    parser.add_argument("--top", type=int, default=15, help="cProfile lines to print (by time in the function itself)")
    args = parser.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    base, dim, described = inference_model("ffn", args.tiny, device, args.blocks)
    model = model_for(args.config, base.train(args.grad), device, args.grad)

    def out_of_time(signum, frame) -> None:
        report(f"still running after {args.budget} s, at:", frame)
        os._exit(0)

    if args.budget:
        signal.signal(signal.SIGALRM, out_of_time)
        signal.alarm(args.budget)
    for rows in map(int, args.rows.split(",")):
        x = torch.randn(rows, dim, device=device, dtype=torch.bfloat16, requires_grad=args.grad)

        def call() -> None:
            if args.grad:
                model(x).sum().backward()
            else:
                with torch.no_grad():
                    model(x)

        title = f"{args.config}{' (forward and backward)' if args.grad else ', no_grad'}: {described}, {rows} rows on {device}"
        profile = cProfile.Profile()

        def report(first: str, frame=None) -> None:
            profile.disable()
            print(f"{title}, torch {torch.__version__}: first call {first}")
            if frame is not None:
                print("".join(traceback.format_stack(frame)[-args.top :]))
            print(compile_times(repr="str", aggregate=True))
            print("Inductor kernels generated:", torch._inductor.metrics.generated_kernel_count)
            print("Dynamo counters:", {k: dict(v) for k, v in counters.items() if k in ("stats", "frames", "recompiles", "graph_break")})
            print(tabulate(phases(pstats.Stats(profile)), headers=["phase (cProfile)", "calls", "cumulative s"], floatfmt=".2f"))
            pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)
            sys.stdout.flush()

        # Each call's figures its own: Dynamo's phase times, Inductor's kernel count and the counters start from nothing.
        compilation_time_metrics.clear()
        torch._inductor.metrics.reset()
        counters.clear()
        profile.enable()
        first, _ = seconds(call, device)
        report(f"{first:.1f} s")
    signal.alarm(0)


if __name__ == "__main__":
    main()
