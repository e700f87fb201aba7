"""An experiment, not a benchmark to keep: moe_step.py's MoE layer under graphquant rowwise, in
variants of what its grouped sites keep for backward and of Inductor's scheduling, side by side:
peak memory above the model (as moe_step.py's), ms per step, and with --memory what is live at
each variant's peak.

    python benchmarks/moe_memory_variants.py [--variants recompute,recompute+noreorder,kept+noreorder] [--memory VARIANTS] [--keep DIR]

recompute: the branch's grouped op (the experts' columnwise weights made again in backward).
kept: the op as on main before it (both directions of the weights in forward, the columnwise
copy kept for backward). bf16: torch.compile without graphquant. +noreorder: Inductor's
reorder_for_peak_memory off.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import training_step, warm_peak_gib  # noqa: E402
from models import MoE  # noqa: E402
from moe_step import SHAPES  # noqa: E402
from train_step import memory_at_peak  # noqa: E402

import graphquant  # noqa: E402
from graphquant import zoo  # noqa: E402
from graphquant.ops import grouped  # noqa: E402
from graphquant.ops.operands import save_columnwise, saved_columnwise  # noqa: E402
from graphquant.quantizers import COLUMNWISE, ROWWISE  # noqa: E402

RECOMPUTE = grouped.QuantizedGroupedMM


class KeptWeights(torch.autograd.Function):
    """The grouped op with the weights' two directions made in forward, the columnwise one kept."""

    @staticmethod
    def forward(ctx, x, w, offs, rng, site):
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        experts, k, n = w.shape
        groups, rows = grouped.groups, grouped.GROUP_ROWS
        tokens = groups.padding(offs, x.shape[0], rows, groups.padded_bound(x.shape[0], experts, rows))
        xq = grouped.quantize_grouped(tokens.pad(x), tokens, site.quantizers[0], (ROWWISE, COLUMNWISE) if need_dw else (ROWWISE,), rng, site.streams[0])
        expert_ends = torch.arange(1, experts + 1, dtype=torch.int32, device=w.device) * n
        stack = groups.padding(expert_ends, experts * n, rows, experts * grouped._padded(n))
        w2d = stack.pad(w.transpose(1, 2).reshape(experts * n, k))
        wq = grouped.quantize_grouped(w2d, stack, site.quantizers[1], (ROWWISE, COLUMNWISE) if need_dx else (ROWWISE,), rng, site.streams[1])
        y = grouped._gemm(xq[ROWWISE], wq[ROWWISE], stack.row_group, tokens, n, torch.promote_types(x.dtype, w.dtype), site, "fprop")
        save_columnwise(ctx, xq.get(COLUMNWISE), wq.get(COLUMNWISE), *tokens, stack.row_group, rng)
        ctx.site, ctx.dtypes, ctx.n = site, (x.dtype, w.dtype), n
        return y

    @staticmethod
    def backward(ctx, dy):
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        x_col, w_col, (*token_layout, w_group, rng) = saved_columnwise(ctx)
        tokens = grouped.groups.GroupPadding(*token_layout)
        directions = ((ROWWISE,) if need_dx else ()) + ((COLUMNWISE,) if need_dw else ())
        dy = tokens.pad(dy)
        gq = grouped.quantize_grouped(dy, tokens, ctx.site.quantizers[2], directions, rng, ctx.site.streams[2])
        dx = dw = None
        if need_dx:
            dx = grouped._gemm(gq[ROWWISE], w_col, w_group, tokens, w_col.shape[1], ctx.dtypes[0], ctx.site, "dgrad")
        if need_dw:
            dw = grouped._gemm(gq[COLUMNWISE], x_col, tokens.row_group, tokens, ctx.n, ctx.dtypes[1], ctx.site, "wgrad").transpose(1, 2)
        return dx, dw, None, None, None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default="recompute,recompute+noreorder,kept+noreorder")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--memory", default="", help="comma-separated variants whose live tensors at the peak to list")
    parser.add_argument("--keep", default=None, help="with --memory: a folder for the allocator traces and the Inductor code at each peak")
    args = parser.parse_args()
    torch.manual_seed(0)
    base = MoE(**SHAPES).cuda()
    x = torch.randn(args.tokens, SHAPES["dim"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    rows = []
    for variant in args.variants.split(","):
        torch._dynamo.reset()
        grouped.QuantizedGroupedMM = KeptWeights if variant.startswith("kept") else RECOMPUTE
        options = {"reorder_for_peak_memory": False} if variant.endswith("+noreorder") else None
        if variant.startswith("bf16"):
            model = torch.compile(copy.deepcopy(base), options=options)
        else:
            model = graphquant.compile(copy.deepcopy(base), zoo.recipe("rowwise"), options=options)
        step = training_step(model, x, grad)
        peak = warm_peak_gib(step)
        times = []
        for _ in range(args.reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        rows.append((variant, statistics.median(times), peak))
        print(f"{variant}: {statistics.median(times):.2f} ms/step, peak {peak:.2f} GiB", flush=True)
        if variant in args.memory.split(","):
            memory_at_peak(variant, step, args.keep)
    grouped.QuantizedGroupedMM = RECOMPUTE
    for variant, ms, peak in rows:
        print(f"| {variant} | {ms:.2f} | {peak:.2f} |")


if __name__ == "__main__":
    main()
