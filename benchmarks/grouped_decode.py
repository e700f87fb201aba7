"""The emulated MXFP8 and NVFP4 expert product at decode and middle sizes, four ways, beside bf16
torch._grouped_mm: codes decoded in the GEMM's registers (triton_decode.experts_gemm) one token a
program or in tiles of 16 tokens, the routed experts' values written first, every
expert's values written first; and MXFP8's codes on the FP8 tensor cores a 32-block at a time
(triton_grouped_fp8, which the plan takes where fprop may accumulate fast) where its tiles apply.

    python benchmarks/grouped_decode.py [--formats mxfp8_block_scaling,nvfp4_block_scaling] [--rows 8,32,64,128,256,1024,2048,16384] [--reps 10] [--tiny]

The gate and up projections of moe_step.py's experts (64 experts, 4096 -> 2816) and their down
projection (1408 -> 4096), ``--rows`` routed rows (tokens times top-k) spread over the experts at
random, the product's bf16 output as graphquant.kernels.grouped.gemm makes it; ms per product, and
the largest relative difference of the four ways' outputs (fp32 accumulation orders alone). Each
way's time is its GPU's: decode_gemm.py's CALLS calls replayed from one CUDA graph, as a model's
CUDA graph runs the product (without one, a call's host time set the pace at a few rows). The
plan's emulated GEMM decodes in registers up to triton_decode.TILED_ROWS_AN_EXPERT routed rows an
expert, one token a program up to triton_decode.ONE_TOKEN_ROWS_AN_EXPERT, both chosen from this
table. ``--tiny``: the CPU at small dims, each way run once, untimed (the decoding kernels
under Triton's interpreter: TRITON_INTERPRET=1; tests/test_grouped_decode_benchmark.py).
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
from tabulate import tabulate

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import time_ms  # noqa: E402
from decode_gemm import CALLS, graphed  # noqa: E402

from graphquant import recipes  # noqa: E402
from graphquant.formats import groups  # noqa: E402
from graphquant.kernels import backends, native, triton_decode, triton_dequantize  # noqa: E402
from graphquant.kernels import grouped as grouped_kernels  # noqa: E402
from graphquant.quantizers import ROWWISE, QuantizeContext  # noqa: E402
from graphquant.roles import QuantizerRole  # noqa: E402

# experts, and each product's k and n: moe_step.py's gate and up projections, and its down one
DIMS = (64, {"gate and up": (4096, 2816), "down": (1408, 4096)})
TINY_DIMS = (4, {"gate and up": (256, 128), "down": (160, 256)})
WAYS = ("one token a program", "16-token tiles", "routed experts' values", "every expert's values")
DECODED = WAYS[:2]  # the codes decoded in the GEMM's registers, by either program
# MXFP8's codes on the FP8 tensor cores a 32-block at a time (triton_grouped_fp8's few-token tiles),
# where fprop may accumulate fast and the tokens lie in groups of 16: its sums are not fp32's, so
# the differences column leaves it out.
MX_WAY = "FP8 tensor cores, 32-blocks"


def stack(quantizer, w: torch.Tensor):
    """(w's expert stack (experts, n, k) quantized rowwise, each stack row's expert)."""
    experts, n, k = w.shape
    layout = groups.uniform_padding(experts, n, groups.GROUP_ROWS, w.device)
    return native.grouped_quantize(quantizer, w.reshape(-1, k), layout.row_group, layout.bounds, ROWWISE, QuantizeContext()), layout.row_group


def token_rows(quantizer, rows: int, experts: int) -> int:
    """The rows an inference graph pads each group of ``rows`` routed rows quantized by
    ``quantizer`` to (few tokens an expert: the plan's rows, backends.token_rows)."""
    return groups.token_block(backends.token_rows(quantizer, True), rows, experts)


def tokens(quantizer, rows: int, experts: int, k: int, device: torch.device):
    """(the routed rows' padded layout, an inference graph's, x's quantized rows in it, x, the offsets)."""
    chosen = torch.randint(0, experts, (rows,), device=device)
    offs = torch.searchsorted(chosen.sort().values, torch.arange(experts, device=device), right=True).to(torch.int32)
    block = token_rows(quantizer, rows, experts)
    layout = groups.padding(offs, rows, block, groups.padded_bound(rows, experts, block))
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    return layout, native.grouped_quantize(quantizer, layout.pad(x), layout.row_group, layout.bounds, ROWWISE, QuantizeContext()), x, offs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default="mxfp8_block_scaling,nvfp4_block_scaling")
    parser.add_argument("--rows", default="8,32,64,128,256,1024,2048,16384")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    experts, products = TINY_DIMS if args.tiny else DIMS
    device = torch.device("cpu" if args.tiny else "cuda")
    timed = (lambda fn: "-") if args.tiny else (lambda fn: f"{time_ms(graphed(fn), reps=args.reps) / CALLS:.3f}")  # noqa: E731
    decodes, live_arguments = grouped_kernels._decodes_in_registers, triton_dequantize._live_arguments
    one_token = triton_decode.one_token_a_program
    emulated = backends.GemmBackend(backends.EMULATION)
    table = []
    for name, (product, (k, n)) in itertools.product(args.formats.split(","), products.items()):
        factory = getattr(recipes, name)().qfactory
        qx, qw = (factory(QuantizerRole("grouped_linear", tensor, "experts")) for tensor in ("input", "weight"))
        w = torch.randn(experts, n, k, device=device, dtype=torch.bfloat16) / k**0.5
        b, b_group = stack(qw, w)
        for rows in map(int, ("8,64" if args.tiny else args.rows).split(",")):
            layout, a, x, offs = tokens(qx, rows, experts, k, device)
            block, times, outputs = token_rows(qx, rows, experts), {}, {}
            try:
                for way in WAYS:
                    grouped_kernels._decodes_in_registers = lambda *given, on=way in DECODED: on
                    triton_decode.one_token_a_program = lambda *given, on=way == WAYS[0]: on
                    every = way == WAYS[3]
                    triton_dequantize._live_arguments = (lambda live, data: live_arguments(None, data)) if every else live_arguments
                    run = lambda: grouped_kernels.gemm(a, b, b_group, layout, block, n, torch.bfloat16, emulated, "experts fprop")  # noqa: E731
                    outputs[way], times[way] = run(), timed(run)
            finally:
                grouped_kernels._decodes_in_registers, triton_dequantize._live_arguments = decodes, live_arguments
                triton_decode.one_token_a_program = one_token
            times[MX_WAY] = "n/a"
            if not args.tiny and qx.gemm_input(ROWWISE).family == "mxfp8" and block == groups.FEW_TOKEN_ROWS:
                mx = backends.GemmBackend(backends.triton_grouped_fp8.MX_BACKEND, fast_accumulation=True)
                times[MX_WAY] = timed(lambda: grouped_kernels.gemm(a, b, b_group, layout, block, n, torch.bfloat16, mx, "experts fprop"))
            bf16 = timed(lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs))
            last = outputs[WAYS[3]].float()
            diff = max(((out.float() - last).norm() / last.norm()).item() for out in outputs.values())
            table.append([name, product, rows, *(times[way] for way in (*WAYS, MX_WAY)), bf16, f"{diff:.1e}"])
            print(table[-1], flush=True)
    headers = ["format", "product", "routed rows", *(f"{way} ms" for way in (*WAYS, MX_WAY)), "bf16 ms", "max rel diff"]
    print(tabulate(table, headers=headers, disable_numparse=True))


if __name__ == "__main__":
    main()
