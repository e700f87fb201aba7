"""The MoE step's grouped quantizes (moe_step.py's shapes) on each of the extension's programs, in
alternating rounds of a process each: the generic tile program alone (GRAPHQUANT_REGISTER_TILE=0
GRAPHQUANT_ROW_STRIP=0), beside it the register tile program (GRAPHQUANT_ROW_STRIP=0), and every
program the extension has (row-scaled FP8's rowwise calls on the row strip program too).

    python benchmarks/grouped_quantize.py [--formats rowwise,tensorwise] [--rounds 2] [--reps 10]

Operands: the four activations the experts quantize in both directions, read through the padded
layout's gather (gate_up's x and grad_output: 4096 and 2816 columns; down's: 1408 and 4096), and
the two expert weight stacks, rowwise with the amaxes their columnwise scales from (forward) and
then columnwise from those amaxes (backward). Each call is its pre-pass (where the format has one),
its scales and its main pass; ms per call, median over rounds of the median over samples.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import torch
from tabulate import tabulate

sys.path.insert(0, __file__.rsplit("/", 1)[0])

# Each program's environment: the switches that turn programs off (read once a process).
PROGRAMS = {
    "generic": {"GRAPHQUANT_REGISTER_TILE": "0", "GRAPHQUANT_ROW_STRIP": "0"},
    "register": {"GRAPHQUANT_ROW_STRIP": "0"},
    "all": {},
}


def calls(name: str):
    """(operand, a call of its grouped quantize) under zoo recipe ``name``'s grouped_linear quantizers."""
    from grouped_gemm import EXPERTS, SITES, TOKENS, TOP_K, quantizers, routed

    from graphquant.formats import groups
    from graphquant.kernels import native
    from graphquant.quantizers import QuantizeContext

    _, tokens = routed()
    qx, qw, qg = quantizers(name)
    for site, (k, n) in SITES.items():
        for what, quantizer, cols in (("x", qx, k), ("grad_output", qg, n)):
            values = torch.randn(TOKENS * TOP_K, cols, device="cuda", dtype=torch.bfloat16)
            yield f"{site} {what}", lambda: native.grouped_quantize_pass(
                quantizer, values, tokens.row_group, tokens.bounds, QuantizeContext(), rowwise=True, columnwise=True,
                source=tokens.source, runs=tokens.runs,
            )
        w = torch.randn(EXPERTS * n, k, device="cuda", dtype=torch.bfloat16)
        stack = groups.uniform_padding(EXPERTS, n, groups.GROUP_ROWS, torch.device("cuda"))

        def rowwise():
            return native.grouped_quantize_pass(
                qw, w, stack.row_group, stack.bounds, QuantizeContext(), rowwise=True, columnwise=False, take_columnwise_amax=True
            )

        yield f"{site} weights, rowwise", rowwise
        amax = rowwise().columnwise_amax
        yield f"{site} weights, columnwise", lambda: native.grouped_quantize_pass(
            qw, w, stack.row_group, stack.bounds, QuantizeContext(), rowwise=False, columnwise=True, columnwise_amax=amax
        )


def child(formats: list[str], reps: int) -> None:
    """One round in this process's program: a JSON line of {format: {operand: ms}}."""
    from common import time_ms

    print(json.dumps({name: {operand: time_ms(call, reps=reps, inner=3) for operand, call in calls(name)} for name in formats}))


def measure(program: str, formats: list[str], reps: int) -> dict:
    """One round in a process of its own, with ``program``'s switches."""
    env = {name: value for name, value in os.environ.items() if name not in PROGRAMS["generic"]}
    env.update(PROGRAMS[program])
    run = subprocess.run([sys.executable, __file__, "--child", "--formats", ",".join(formats), "--reps", str(reps)],
                         env=env, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"the {program} round failed:\n{run.stdout}{run.stderr}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def table(rounds: dict[str, list[dict]]) -> str:
    """The median ms of each format's operands on each program, the others' speedups over the
    first, and each format's total."""
    ms = {program: {(name, operand): statistics.median(r[name][operand] for r in samples) for name in samples[0] for operand in samples[0][name]}
          for program, samples in rounds.items()}
    programs = list(ms)
    cells = {key: {program: ms[program][key] for program in programs} for key in ms[programs[0]]}
    names = dict.fromkeys(name for name, _ in cells)
    cells |= {(name, "all"): {p: sum(t[p] for (n, _), t in cells.items() if n == name) for p in programs} for name in names}
    rows = [[name, operand, *(f"{times[p]:.3f}" for p in programs), *(f"{times[programs[0]] / times[p]:.2f}x" for p in programs[1:])]
            for (name, operand), times in cells.items()]
    headers = ["format", "operand", *(f"{p} ms" for p in programs), *(f"{p}'s speedup" for p in programs[1:])]
    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default="rowwise,tensorwise", help="zoo recipes whose grouped_linear quantizers to time")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    formats = args.formats.split(",")
    if args.child:
        return child(formats, args.reps)
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    rounds = {program: [] for program in PROGRAMS}
    for _ in range(args.rounds):
        for program in PROGRAMS:
            rounds[program].append(measure(program, formats, args.reps))
    print(table(rounds))


if __name__ == "__main__":
    main()
