"""The grouped GEMMs of an MoE layer's experts, alone: bf16 torch._grouped_mm against graphquant's
native FP8 grouped GEMMs (the Triton FP8 grouped GEMM at each promotion interval asked for,
graphquant's CUDA one (grouped_fp8: promoted) where the extension has it,
torch._scaled_grouped_mm) on quantized operands in the padded layout, fprop, dgrad and wgrad.

    python benchmarks/grouped_gemm.py [--sites gate_up,down] [--formats rowwise,mxfp8_block_scaling] [--promote fast,32,128] [--emulated]

Shapes: moe_step.py's (16384 tokens, top-8 of 64 experts, dim 4096, expert hidden 1408: gate_up
4096 -> 2816, down 1408 -> 4096), the tokens routed at random. ``--promote``: the Triton GEMM's
sums promoted into fp32 every so many products, or every K tile where a tile is shorter (128,
fp8.PROMOTED_PRODUCTS, is what the plan picks where a recipe keeps fp32 sums), or ``fast``, never
(the tensor cores' accumulator alone, which the plan picks where a recipe lets a per-tensor or
per-row GEMM accumulate fast and graphquant's CUDA kernel does not run; block scales always
promote, so their GEMMs are not timed fast).
torch._scaled_grouped_mm (fast accumulation, its padded product un-padded afterwards; the plan's
choice only where Triton is not installed) is timed for the pairs it takes; ``--emulated`` also
times the emulated GEMM (dequantize, then bf16) of each. A format is a zoo recipe or one of
graphquant.recipes (mxfp8_block_scaling). Prints ms and TFLOP/s (of the unpadded GEMM) per GEMM,
the speed over bf16, and how far each FP8 product lies from the Triton GEMM's as the plan
promotes it (relative Frobenius norm of the difference).
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Optional

import torch
from tabulate import tabulate

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import time_ms  # noqa: E402

from graphquant import recipes, zoo  # noqa: E402
from graphquant.formats import groups  # noqa: E402
from graphquant.kernels import backends, grouped_fp8, native  # noqa: E402
from graphquant.kernels import grouped_operands  # noqa: E402
from graphquant.kernels import grouped as grouped_kernels  # noqa: E402
from graphquant.quantizers import COLUMNWISE, ROWWISE, QuantizeContext  # noqa: E402
from graphquant.roles import QuantizerRole  # noqa: E402

TOKENS, TOP_K, EXPERTS = 16384, 8, 64
SITES = {"gate_up": (4096, 2816), "down": (1408, 4096)}  # (k: x's columns, n: each expert's outputs)


def quantizers(name: str):
    """(input, weight, grad_output) quantizers of recipe ``name`` (the zoo's, or graphquant.recipes')
    for a grouped_linear."""
    factory = (zoo.recipe(name) if name in zoo.FACTORIES else getattr(recipes, name)()).qfactory
    return [factory(QuantizerRole("grouped_linear", tensor, "experts")) for tensor in ("input", "weight", "grad_output")]


def routed(device: str = "cuda"):
    """(offs, the padded layout of the routed rows) of TOKENS tokens routed top-TOP_K of EXPERTS
    at random."""
    torch.manual_seed(0)
    chosen = torch.randn(TOKENS, EXPERTS, device=device).topk(TOP_K, dim=-1).indices.reshape(-1)
    offs = torch.searchsorted(chosen.sort().values, torch.arange(EXPERTS, device=device), right=True).to(torch.int32)
    rows = TOKENS * TOP_K
    tokens = groups.padding(offs, rows, groups.GROUP_ROWS, groups.padded_bound(rows, EXPERTS, groups.GROUP_ROWS))
    return offs, tokens


def operands(name: str, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, tokens) -> dict:
    """{GEMM: (A, B, B's row groups, the output's width)} of one expert site under zoo recipe
    ``name``: x (rows, k), w (experts, n, k), dy (rows, n) quantized as graphquant.ops.grouped
    lays them out (tokens padded, the weights as a stack of experts)."""
    experts, n, k = w.shape
    qx, qw, qg = quantizers(name)
    stack = groups.uniform_padding(experts, n, groups.GROUP_ROWS, w.device)

    def quantized(quantizer, values, layout, direction):
        return native.grouped_quantize(quantizer, values, layout.row_group, layout.bounds, direction, QuantizeContext())

    xp, dyp = tokens.pad(x), tokens.pad(dy)
    return {
        "fprop": (quantized(qx, xp, tokens, ROWWISE), quantized(qw, w.reshape(-1, k), stack, ROWWISE), stack.row_group, n),
        "dgrad": (quantized(qg, dyp, tokens, ROWWISE), quantized(qw, w.reshape(-1, k), stack, COLUMNWISE), stack.row_group, k),
        "wgrad": (quantized(qg, dyp, tokens, COLUMNWISE), quantized(qx, xp, tokens, COLUMNWISE), tokens.row_group, n),
    }


def intervals(text: str) -> list[Optional[int]]:
    """--promote's promotion intervals: ``fast`` is the kernels' FAST_ACCUMULATION."""
    kernels = backends.triton_grouped_fp8
    return [kernels.FAST_ACCUMULATION if item == "fast" else int(item) for item in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sites", default="gate_up,down")
    parser.add_argument("--formats", default="rowwise,deepseek_blockwise")
    parser.add_argument("--promote", default="fast,128", help="comma-separated promotion intervals of the Triton GEMM to time, or fast (none)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--emulated", action="store_true", help="also time the emulated GEMM of each")
    args = parser.parse_args()
    offs, tokens = routed()
    rows = TOKENS * TOP_K
    kernels = backends.triton_grouped_fp8
    scaled = backends.NATIVE_GROUPED_GEMM
    scaled_backend = backends.GemmBackend(scaled.backend, fast_accumulation=True)
    table = []
    for site in args.sites.split(","):
        k, n = SITES[site]
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(EXPERTS, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        dy = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
        flops = 2.0 * rows * k * n
        bf16 = {
            "fprop": lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs),
            "dgrad": lambda: torch._grouped_mm(dy, w, offs=offs),
            "wgrad": lambda: torch._grouped_mm(dy.t(), x, offs=offs),
        }
        bf16_ms = {}
        for gemm, fn in bf16.items():
            bf16_ms[gemm] = time_ms(fn, reps=args.reps)
            table.append([site, gemm, "bf16 torch._grouped_mm", f"{bf16_ms[gemm]:.3f}", f"{flops / bf16_ms[gemm] / 1e9:.0f}", "1.00x", ""])
        for name in args.formats.split(","):
            for gemm, (a, b, b_group, width) in operands(name, x, w, dy, tokens).items():
                def direct(module, promote_every):  # the Triton or CUDA kernel, as grouped.gemm calls it
                    if a.direction == ROWWISE:
                        return module.tokens_by_experts(a, b, b_group, tokens, groups.GROUP_ROWS, width, torch.bfloat16, promote_every)
                    return module.tokens_by_tokens(a, tokens.row_group, b, b_group, tokens.ends, width, torch.bfloat16, promote_every)

                def on(backend):
                    return grouped_kernels.gemm(a, b, b_group, tokens, groups.GROUP_ROWS, width, torch.bfloat16, backend, f"{site} {gemm}")

                runs = {}
                block_scaled = grouped_operands.block_scaled(a)
                inputs = (a.quantizer.gemm_input(a.direction), b.quantizer.gemm_input(b.direction))
                cuda = grouped_fp8.extension_runs(a.data.device) and backends.WGMMA_GROUPED_GEMM.takes(*inputs)
                for interval in intervals(args.promote):
                    if interval is kernels.FAST_ACCUMULATION and block_scaled:
                        continue  # block scales always promote: no plan runs them fast
                    label = "fast accumulation" if interval is kernels.FAST_ACCUMULATION else f"promoted every {interval}"
                    runs[f"{kernels.BACKEND}, {label}"] = functools.partial(direct, kernels, interval)
                    if cuda and interval == grouped_fp8.PROMOTE_EVERY:
                        runs[f"{grouped_fp8.BACKEND}, {label}"] = functools.partial(direct, grouped_fp8, interval)
                if scaled.takes(*inputs) and scaled.runs_on(torch.cuda.get_device_capability()):
                    runs[str(scaled_backend)] = functools.partial(on, scaled_backend)
                if args.emulated:
                    runs[backends.EMULATION] = functools.partial(on, backends.GemmBackend(backends.EMULATION))
                promoted = direct(kernels, kernels.PROMOTE_EVERY).double()
                for label, fn in runs.items():
                    difference = (fn().double() - promoted).norm() / promoted.norm()
                    ms = time_ms(fn, reps=args.reps)
                    table.append([site, gemm, f"{name}: {label}", f"{ms:.3f}", f"{flops / ms / 1e9:.0f}", f"{bf16_ms[gemm] / ms:.2f}x", f"{difference:.1e}"])
                del promoted
        print(tabulate(table, headers=["site", "GEMM", "backend", "ms", "TFLOP/s", "vs bf16", f"vs promoted every {kernels.PROMOTE_EVERY}"]), flush=True)
        table.clear()


if __name__ == "__main__":
    main()
