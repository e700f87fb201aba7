"""The MoE step's grouped quantizes (moe_step.py's shapes): each group's amaxes taken in the main
pass's launch, a group ahead of its encoding (csrc/cuda/params.h, GroupOrder), beside the amax
pre-pass, the finalize launches and the main pass one after another; alternating rounds, and
whether both give the same bits.

    python benchmarks/grouped_quantize.py [--formats rowwise,tensorwise] [--rounds 5] [--reps 10]

Operands: the four activations the experts quantize in both directions, read through the padded
layout's gather (gate_up's x and grad_output, 4096 and 2816 columns; down's, 1408 and 4096), and
the two expert weight stacks, rowwise with the amaxes their backward's columnwise scales from.
"floor ms": the call's bytes at a device-to-device copy's bandwidth measured in the same run, x
read once (the pre-pass's read not counted) and every output byte written.
"""

from __future__ import annotations

import argparse
import sys

import torch
from tabulate import tabulate

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import alternate  # noqa: E402
from grouped_gemm import EXPERTS, SITES, TOKENS, TOP_K, quantizers, routed  # noqa: E402

from graphquant.formats import groups  # noqa: E402
from graphquant.kernels import native  # noqa: E402
from graphquant.quantizers import QuantizeContext  # noqa: E402

ORDERS = ("group order", "one after another")


def calls(name: str, tokens) -> dict:
    """{operand: (a call of its grouped quantize, its bytes read once and written)} under zoo
    recipe ``name``."""
    qx, qw, qg = quantizers(name)
    rows = TOKENS * TOP_K
    made = {}
    for site, (k, n) in SITES.items():
        for what, quantizer, cols in (("x", qx, k), ("grad_output", qg, n)):
            values = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
            made[f"{site} {what}"] = (
                lambda quantizer=quantizer, values=values: native.grouped_quantize_pass(
                    quantizer, values, tokens.row_group, tokens.bounds, QuantizeContext(), rowwise=True, columnwise=True,
                    source=tokens.source, runs=tokens.runs,
                ),
                values.numel() * 2 + 2 * tokens.padded_rows * cols,
            )
        w = torch.randn(EXPERTS * n, k, device="cuda", dtype=torch.bfloat16)
        stack = groups.padding(torch.arange(1, EXPERTS + 1, dtype=torch.int32, device="cuda") * n, EXPERTS * n, groups.GROUP_ROWS, EXPERTS * n)
        made[f"{site} weights"] = (
            lambda w=w, stack=stack: native.grouped_quantize_pass(
                qw, w, stack.row_group, stack.bounds, QuantizeContext(), rowwise=True, columnwise=False, take_columnwise_amax=True
            ),
            w.numel() * 3,
        )
    return made


def in_order(call, ordered: bool):
    def run():
        before = native.extension().set_ordered_groups(ordered)
        try:
            return call()
        finally:
            native.extension().set_ordered_groups(before)

    return run


def same_bits(a, b) -> bool:
    def bits(made):
        tensors = [t for rep in (made.rowwise, made.columnwise) if rep is not None for t in rep.tensors()]
        tensors += [made.columnwise_amax] if made.columnwise_amax is not None else []
        return [t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32) if t.element_size() == 4 else t for t in tensors]

    return all(torch.equal(x, y) for x, y in zip(bits(a), bits(b), strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default="rowwise,tensorwise", help="zoo recipes whose grouped_linear quantizers to time")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    _, tokens = routed()
    copy_source = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    copy_target = torch.empty_like(copy_source)
    rows, totals = [], {}
    for name in args.formats.split(","):
        for operand, (call, moved) in calls(name, tokens).items():
            fns = {order: in_order(call, order == ORDERS[0]) for order in ORDERS}
            fns["copy"] = lambda: copy_target.copy_(copy_source)
            ms = alternate(fns, rounds=args.rounds, reps=args.reps, inner=3)
            floor = ms["copy"] * moved / (2 * copy_source.numel())
            for order in ORDERS:
                totals[name, order] = totals.get((name, order), 0.0) + ms[order]
            totals[name, "floor"] = totals.get((name, "floor"), 0.0) + floor
            same = same_bits(fns[ORDERS[0]](), fns[ORDERS[1]]())
            rows.append([name, operand, f"{ms[ORDERS[1]]:.3f}", f"{ms[ORDERS[0]]:.3f}", f"{ms[ORDERS[1]] / ms[ORDERS[0]]:.2f}x", f"{floor:.3f}", same])
        rows.append([name, "all six", f"{totals[name, ORDERS[1]]:.3f}", f"{totals[name, ORDERS[0]]:.3f}",
                     f"{totals[name, ORDERS[1]] / totals[name, ORDERS[0]]:.2f}x", f"{totals[name, 'floor']:.3f}", ""])
    print(tabulate(rows, headers=["format", "operand", "one after another ms", "group order ms", "speedup", "floor ms", "same bits"], tablefmt="github"))


if __name__ == "__main__":
    main()
