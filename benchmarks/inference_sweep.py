"""Milliseconds per forward of Llama-3-8B SwiGLU FFN blocks (or an MoE layer) under
torch.no_grad(), at each row count, under every inference configuration side by side.

    python benchmarks/inference_sweep.py [--tiny] [--model ffn|moe] [--deterministic] [--rows 1,16,128,2048,16384] [--blocks 2]
                                         [--configs NAME,...] [--rounds 3] [--cudagraphs] [--budget SECONDS]

The model is ``--blocks`` FeedForward blocks of models.py (RMSNorm, then the SwiGLU w2(silu(w1 n)
* w3 n) with w1, w3: 4096->14336 and w2: 14336->4096, and the residual), bf16 weights; with
``--model moe``, moe_step.py's MoE layer (64 experts, top-8, expert hidden 1408, a shared expert of
2816, its experts two grouped GEMMs), whose frozen configurations store the expert stacks too
(called once at the first row count before graphquant.freeze); its "= per-call" is "n/a" on CUDA
unless ``--deterministic`` (its index_add sums by atomics, in any order). The input is (rows, 4096) bf16,
the same for every configuration. The configurations are those of
inference_configs.py (bf16 torch.compile, torchao's dynamic FP8, graphquant's recipes per-call
and frozen); each compiles a graph per row count (dynamic=False).

Each cell is the median over ``--rounds`` of ms per forward (CUDA events around ten calls back to
back, issued behind one more call queued before the start event, so that the host's launches
overlap the GPU from the first timed call on, as in a serving loop's steady state; each round runs every
configuration at every row count in its own shuffled order) and the speedup over bf16
torch.compile at that row count; a second table gives the host's milliseconds per call in those
samples (the calls' wall clock, the GPU not waited for) and their share of the cell's time: near
100%, the host's per-call work (Dynamo's guards, CUDA graph trees' input copies and checks, the
launches), not the GPU, set the pace. "first call s" is the first call at the first row count (the
plan and the compile of its graph), "next rows s" the mean first call at each other row count
(a compile each). "weights GB" counts every parameter and buffer (1e9 bytes; a tensor subclass by
its inner tensors). "= per-call" says whether a frozen configuration's outputs equal its per-call
one's bit for bit at every row count. A configuration that fails at a row count is listed under
the table and the others still run; ``--budget`` leaves out the row counts not compiled by then
(a first call still compiling is interrupted), so that a run with a time limit of the budget plus
the timing (seconds) still prints its table.
``--tiny``: on the CPU, with small dims and aot_eager (no Inductor build): a check that every
configuration runs, whose times mean nothing.
"""

from __future__ import annotations

import argparse
import functools
import signal
import sys
import time
import traceback

import torch
from tabulate import tabulate
from torch._dynamo.utils import counters

from graphquant.kernels import native

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import alternate, seconds, time_ms, wall_ms  # noqa: E402
from inference_configs import BF16, allow_graphs, build, configs, inference_model, per_call, weight_bytes  # noqa: E402


def why(error: Exception) -> str:
    return f"{type(error).__name__}: {error}".splitlines()[0][:200]


class Run:
    """One configuration's model, called once at each row count (compiles included) and once
    more (CUDA graphs record on the first replays): per row count the first call's seconds and
    output, or why it failed, or that it was left out, past ``deadline`` (perf_counter seconds);
    and the model's weight bytes."""

    def __init__(self, name: str, model: torch.nn.Module, inputs: dict[int, torch.Tensor], device: torch.device, deadline: float) -> None:
        self.model, self.weight_bytes = model, weight_bytes(model)
        self.first, self.outputs, self.failed, self.left_out = {}, {}, {}, []
        for rows, x in inputs.items():
            if time.perf_counter() > deadline:
                self.left_out.append(rows)
                continue
            try:
                skips = counters["inductor"]["cudagraph_skips"]
                self.first[rows], output = seconds(functools.partial(model, x), device)
                self.outputs[rows] = output.clone()  # a CUDA graph's output is overwritten by its next replay
                model(x)
                skipped = counters["inductor"]["cudagraph_skips"] - skips  # Inductor logs why, above
                print(f"  {name} @{rows} rows: first call {self.first[rows]:.1f} s"
                      f"{f', CUDA graphs skipped for {skipped} graph(s)' if skipped else ''}", flush=True)
            except Exception as error:  # the other row counts' numbers stay, and the failure is listed
                self.first.pop(rows, None), self.outputs.pop(rows, None)
                if time.perf_counter() > deadline:  # OutOfTime, raised into the compile (or wrapped by Dynamo)
                    self.left_out.append(rows)
                    print(f"  {name} @{rows} rows: left out, still compiling at the --budget", flush=True)
                    continue
                self.failed[rows] = why(error)
                print(f"  {name} @{rows} rows: FAILED {self.failed[rows]}", flush=True)
                traceback.print_exc()


class OutOfTime(Exception):
    """The --budget ran out during a first call: raised into it, so that the run times what was
    compiled by then and prints its table."""


def out_of_time(signum, frame) -> None:
    raise OutOfTime("past the --budget")


def table(runs: dict[str, Run], ms: dict[tuple[str, int], float], rows: list[int], comparable: bool) -> str:
    def cell(name: str, r: int) -> str:
        if (name, r) not in ms:
            return "left out" if r in runs[name].left_out else "failed"
        baseline = ms.get((BF16, r))
        return f"{ms[name, r]:.3f}" + (f" ({baseline / ms[name, r]:.2f}x)" if baseline else "")

    lines = []
    for name, run in runs.items():
        first = list(run.first.values())
        unfrozen = runs.get(per_call(name))
        same = "" if unfrozen is None or comparable else "n/a"
        if unfrozen is not None and comparable:
            common_rows = run.outputs.keys() & unfrozen.outputs.keys()
            same = "yes" if common_rows and all(torch.equal(run.outputs[r], unfrozen.outputs[r]) for r in common_rows) else "NO"
        lines.append([
            name, *(cell(name, r) for r in rows), f"{run.weight_bytes / 1e9:.3g}",
            f"{first[0]:.1f}" if first else "", f"{sum(first[1:]) / len(first[1:]):.1f}" if first[1:] else "", same,
        ])
    headers = ["config", *(f"ms @{r} rows" for r in rows), "weights GB", "first call s", "next rows s", "= per-call"]
    return tabulate(lines, headers=headers, disable_numparse=True)


def host_table(runs: dict[str, Run], ms: dict[tuple[str, int], float], host: dict[tuple[str, int], float], rows: list[int]) -> str:
    lines = [
        [name, *(f"{host[name, r]:.3f} ({100 * host[name, r] / ms[name, r]:.0f}%)" if (name, r) in host else "" for r in rows)]
        for name in runs
    ]
    return tabulate(lines, headers=["config", *(f"host ms @{r} rows" for r in rows)], disable_numparse=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the CPU, dims 128 and 256, aot_eager: a check that every configuration runs")
    parser.add_argument("--rows", default=None, help="row counts, comma-separated (default 1,16,128,2048,16384; 1,16 with --tiny)")
    parser.add_argument("--model", choices=("ffn", "moe"), default="ffn")
    parser.add_argument("--blocks", type=int, default=2, help="FFN blocks")
    parser.add_argument("--deterministic", action="store_true",
                        help="torch.use_deterministic_algorithms(True) for the whole run: the MoE layer's index_add then sums in "
                             "a fixed order, so that '= per-call' compares its outputs (n/a without it on CUDA), and every "
                             "configuration's time includes that slower index_add")
    parser.add_argument("--configs", default=None, help="comma-separated configuration names, built in this order (default: all available)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cudagraphs", action="store_true", help="compile every configuration with mode='reduce-overhead'")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds: row counts and configurations not compiled when this much time has passed are left "
                             "out (a compile in progress is interrupted), so that a run with a time limit still ends with its table")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.tiny else "cuda")
    rows = [int(r) for r in (args.rows or ("1,16" if args.tiny else "1,16,128,2048,16384")).split(",")]
    names = configs(args.configs.split(",") if args.configs else None, device)

    torch.use_deterministic_algorithms(args.deterministic)
    base, dim, described = inference_model(args.model, args.tiny, device, args.blocks)
    inputs = {r: torch.randn(r, dim, generator=torch.Generator().manual_seed(r)).to(device, torch.bfloat16) for r in rows}
    print(f"{described} on {device}, "
          f"torch {torch.__version__}, torch.no_grad(), rows {rows}, {args.rounds} rounds"
          f"{', CUDA graphs' if args.cudagraphs else ''}", flush=True)
    if device.type == "cuda" and native.extension() is None:
        print("graphquant's CUDA extension is not built: its quantizes run the reference numerics in torch ops, "
              "so its rows do not time its kernels (build it: pip install -e . or gpu.sh build)", flush=True)

    allow_graphs(len(names) * len(rows))
    runs: dict[str, Run] = {}
    failed: dict[str, str] = {}
    deadline = time.perf_counter() + (args.budget if args.budget is not None else float("inf"))
    if args.budget is not None:  # a compile may run for minutes: the budget interrupts it
        signal.signal(signal.SIGALRM, out_of_time)
        signal.setitimer(signal.ITIMER_REAL, args.budget)
    with torch.no_grad():
        for name in names:
            if time.perf_counter() > deadline:
                print(f"  {name}: left out, past the --budget of {args.budget:g} s", flush=True)
                continue
            try:
                model = build(name, base, device, args.cudagraphs, example=inputs[rows[0]])
            except Exception as error:  # torchao missing a piece, a recipe the model cannot take: listed
                if time.perf_counter() > deadline:
                    print(f"  {name}: left out, past the --budget of {args.budget:g} s", flush=True)
                    continue
                failed[name] = why(error)
                print(f"  {name}: FAILED to build: {failed[name]}", flush=True)
                traceback.print_exc()
                continue
            runs[name] = Run(name, model, inputs, device, deadline)
            failed.update({f"{name} @{r} rows": reason for r, reason in runs[name].failed.items()})
        signal.setitimer(signal.ITIMER_REAL, 0)
        del base
        fns = {(name, r): functools.partial(run.model, inputs[r]) for name, run in runs.items() for r in run.outputs}
        # back-to-back calls between the events behind one queued, as in a serving loop: the host's launches overlap the GPU
        host: dict[tuple[str, int], float] = {}
        timing = dict(timer=time_ms, inner=10, queued=1, reps=5, host=host) if device.type == "cuda" else dict(timer=wall_ms)
        ms = alternate(fns, rounds=args.rounds, **timing)

    print()
    # On CUDA the MoE layer's index_add sums the experts' outputs by atomics, in any order: two calls
    # of one model differ in their last bits unless deterministic algorithms fix the order.
    comparable = not (args.model == "moe" and device.type == "cuda" and not args.deterministic)
    print(table(runs, ms, rows, comparable))
    if host:
        print()
        print("host ms per call (the calls' wall clock, the GPU not waited for; the share of the cell's time: near 100% the host set the pace)")
        print(host_table(runs, ms, host, rows))
    for name, reason in failed.items():
        print(f"{name}: failed: {reason}")


if __name__ == "__main__":
    main()
