"""Where a decode step's time goes: the kernels of one forward of the inference sweep's FFN (two
Llama-3-8B SwiGLU blocks, or with ``--model moe`` its MoE layer) at a few rows, per
configuration, with each kernel's launches and GPU microseconds, their sum, and the span from the
first kernel's start to the last one's end (the host's launches set the gaps between kernels
here; under CUDA graphs each launch boundary still costs about 1.5-2 us: time the forwards with
inference_sweep.py --cudagraphs).

    python benchmarks/decode_profile.py [--model ffn|moe] [--configs NAME,...] [--rows 1,16] [--quantize-first] [--products]

--quantize-first adds each graphquant configuration again with its plan refused the decode GEMM
that quantizes the activation itself (the activation quantized first, then the plain decode
GEMM), so that both are profiled in one run. --products (MXFP8 and NVFP4 expert stacks): each
decoding product of one forward (triton_decode.experts_gemm) again alone, its GPU time from a CUDA
graph of decode_gemm.py's CALLS calls, with its operands' shapes: the model's own routing, to set
beside grouped_decode.py's random one.
"""

from __future__ import annotations

import argparse
import sys

import torch
from tabulate import tabulate

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import cuda_kernels, time_ms  # noqa: E402
from decode_gemm import CALLS, graphed  # noqa: E402
from inference_configs import QUANTIZE_FIRST, allow_graphs, build, inference_model  # noqa: E402

from graphquant.kernels import triton_decode  # noqa: E402

DEFAULT_CONFIGS = "bf16 torch.compile,graphquant tensorwise frozen,graphquant rowwise frozen,graphquant deepseek_blockwise frozen"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("ffn", "moe"), default="ffn", help="the sweep's FFN, or its MoE layer")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS)
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--quantize-first", action="store_true")
    parser.add_argument("--products", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda")
    rows = [int(r) for r in args.rows.split(",")]
    base, dim, described = inference_model(args.model, False, device)
    print(f"{described}, torch {torch.__version__}")
    names = args.configs.split(",")
    if args.quantize_first:
        names += [name + QUANTIZE_FIRST for name in names if name.startswith("graphquant")]
    allow_graphs(len(names) * len(rows))
    summary, products = [], []
    experts_gemm, calls = triton_decode.experts_gemm, []
    if args.products:
        triton_decode.experts_gemm = lambda *call: calls.append(call) or experts_gemm(*call)
    with torch.no_grad():
        for name in names:
            model = build(name, base, device, False, example=torch.randn(rows[0], dim, device=device, dtype=torch.bfloat16))
            for r in rows:
                x = torch.randn(r, dim, device=device, dtype=torch.bfloat16)
                found, span = cuda_kernels(lambda: model(x))  # the warm-up plans its graph
                calls.clear()
                if args.products:
                    model(x)  # its decoding products recorded, each timed alone below
                for a, b, tokens, n, out_dtype in list(calls):
                    alone_us = time_ms(graphed(lambda: experts_gemm(a, b, tokens, n, out_dtype)), reps=10) / CALLS * 1e3
                    live = int((torch.diff(tokens.ends, prepend=tokens.ends.new_zeros(1)) > 0).sum())
                    products.append([name, r, f"{b.shape[1]} -> {n}", tokens.position.shape[0], tokens.row_group.shape[0], live, f"{alone_us:.1f}"])
                launches, busy = sum(c for _, c, _ in found), sum(us for _, _, us in found)
                summary.append([name, r, launches, f"{busy:.1f}", f"{span:.1f}"])
                print(f"\n{name} @{r} rows: {launches} launches, {busy:.1f} us on the GPU, span {span:.1f} us")
                print(tabulate(sorted(((n[:110], c, f"{us:.1f}") for n, c, us in found), key=lambda row: -float(row[2])),
                               headers=["kernel", "launches", "us"], disable_numparse=True), flush=True)
    print()
    print(tabulate(summary, headers=["config", "rows", "launches", "GPU us", "span us"], disable_numparse=True))
    if products:
        print()
        print(tabulate(products, headers=["config", "rows", "product", "routed rows", "padded rows", "live experts", "us alone"], disable_numparse=True))


if __name__ == "__main__":
    main()
