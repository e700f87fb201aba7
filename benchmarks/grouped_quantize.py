"""The MoE step's grouped quantizes (moe_step.py's shapes) on the register tile program beside the
generic tile program (GRAPHQUANT_REGISTER_TILE=0), in alternating rounds of a process each.

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

PROGRAMS = ("generic", "register")


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
        stack = groups.padding(torch.arange(1, EXPERTS + 1, dtype=torch.int32, device="cuda") * n, EXPERTS * n, groups.GROUP_ROWS, EXPERTS * n)

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


def measure(register: bool, formats: list[str], reps: int) -> dict:
    """One round in a process of its own, on the register tile program or the generic one."""
    env = dict(os.environ)
    env.pop("GRAPHQUANT_REGISTER_TILE", None)
    if not register:
        env["GRAPHQUANT_REGISTER_TILE"] = "0"
    run = subprocess.run([sys.executable, __file__, "--child", "--formats", ",".join(formats), "--reps", str(reps)],
                         env=env, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"the {PROGRAMS[register]} round failed:\n{run.stdout}{run.stderr}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def table(rounds: dict[str, list[dict]]) -> str:
    """The median ms of each format's operands on both programs, their ratio, and each format's total."""
    ms = {program: {(name, operand): statistics.median(r[name][operand] for r in samples) for name in samples[0] for operand in samples[0][name]}
          for program, samples in rounds.items()}
    rows, totals = [], {}
    for name, operand in ms["generic"]:
        generic, register = ms["generic"][name, operand], ms["register"][name, operand]
        total = totals.setdefault(name, [0.0, 0.0])
        total[0] += generic
        total[1] += register
        rows.append([name, operand, f"{generic:.3f}", f"{register:.3f}", f"{generic / register:.2f}x"])
    rows += [[name, "all", f"{generic:.3f}", f"{register:.3f}", f"{generic / register:.2f}x"] for name, (generic, register) in totals.items()]
    return tabulate(rows, headers=["format", "operand", "generic ms", "register ms", "register's speedup"], tablefmt="github",
                    disable_numparse=True)


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
            rounds[program].append(measure(program == "register", formats, args.reps))
    print(table(rounds))


if __name__ == "__main__":
    main()
