"""DeepSeek-V3's block-scaled FP8 GEMM (1x128 by 128x128) on Hopper: graphquant's own kernel
(graphquant._C.block_gemm, its K split where the output's tiles fill few SMs, and unsplit) beside
cuBLASLt's blockwise GEMM as the plan calls it (k padded to a multiple of scaled_mm.TILE_SCALED_K
each call where k / 128 is no multiple of 4) and as a raw torch._scaled_mm call of already padded
operands, cuBLASLt's per-tensor FP8 GEMM of the same codes (the same tensor-core work without
block scales to apply: the speed a block-scaled GEMM would need to match a per-row one, whose
scales cost nothing inside the product), and bf16 torch.mm, in the same run, alternating, each
replayed from a CUDA graph (GPU time: at a few rows every eager call's host time exceeds its
kernel's).

    python benchmarks/block_gemm.py [--rows 64,256,1024,4096,16384] [--weights 4096x11008,...,14336x4096,4096x14336]

A weight NxK is B (n, k): 4096x11008 is Llama-2's down projection (its dgrad too), 4096x2816 and
4096x1408 an MoE shared expert's and an expert's, 2816x4096, 14336x4096 and 4096x14336 (Llama-3-8B's
gate and up projections and its down projection) a k cuBLASLt takes as it is. The plan runs the
first three on graphquant's kernel and the last three on cuBLASLt's (backends.BLOCK_SCALED_GEMM),
which splits no K: at a few rows "graphquant" against "cuBLASLt raw" says whether the split
kernel should take those too.
"""

from __future__ import annotations

import argparse
import sys

import torch
from tabulate import tabulate

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import alternate, graphed  # noqa: E402

from graphquant.kernels import backends, block_scaled, scaled_mm  # noqa: E402
from graphquant.quantizers import ROWWISE, Float8BlockQuantizer, QuantizeContext  # noqa: E402


CALLS = 10  # a CUDA graph's calls of each GEMM: GPU time, where a few rows' eager calls would time the host


def operand(quantizer, rows: int, k: int):
    source = (torch.randn(rows, k, device="cuda") * torch.rand(rows, 1, device="cuda") * 4).to(torch.bfloat16)
    return quantizer(source, rowwise=True, columnwise=False, ctx=QuantizeContext()).get(ROWWISE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="64,256,1024,4096,16384")
    parser.add_argument("--weights", default="4096x11008,4096x2816,4096x1408,2816x4096,14336x4096,4096x14336")
    args = parser.parse_args()
    if not block_scaled.extension_runs(torch.device("cuda")):
        sys.exit("graphquant's extension is not built for this GPU: run `pip install -e .` on an sm_90 machine")
    on_cublaslt, ours = backends.GemmBackend(scaled_mm.BLOCKWISE), backends.GemmBackend(block_scaled.BACKEND)
    rows = []
    for weight in args.weights.split(","):
        n, k = map(int, weight.split("x"))
        for m in map(int, args.rows.split(",")):
            a, b = operand(Float8BlockQuantizer(block_scaling_dim=1), m, k), operand(Float8BlockQuantizer(block_scaling_dim=2), n, k)
            x, w = torch.randn(m, k, device="cuda", dtype=torch.bfloat16), torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            call, kwargs = scaled_mm.arguments(scaled_mm.BLOCKWISE, a, b, torch.bfloat16)
            one = torch.ones((), device="cuda")
            fns = {
                "bf16": lambda: torch.mm(x, w.t()),
                "graphquant": lambda: block_scaled.gemm(a, b, torch.bfloat16),
                "graphquant, K unsplit": lambda: block_scaled.gemm(a, b, torch.bfloat16, splits=1),
                "cuBLASLt as planned": lambda: scaled_mm.run(on_cublaslt, a, b, torch.bfloat16),
                "cuBLASLt raw": lambda: torch._scaled_mm(*call, **kwargs),
                "cuBLASLt per tensor": lambda: torch._scaled_mm(a.data, b.data.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
            }
            times = {name: ms / CALLS for name, ms in alternate({name: graphed(fn, CALLS) for name, fn in fns.items()}, rounds=5).items()}
            planned = backends.select(
                Float8BlockQuantizer(block_scaling_dim=1), ROWWISE, Float8BlockQuantizer(block_scaling_dim=2), ROWWISE, a.data.device, (m, n, k)
            ).backend
            rows.append(
                [f"{m}x{n}x{k}", *(f"{times[name] * 1000:.1f}" for name in fns), f"{times['cuBLASLt as planned'] / times['graphquant']:.2f}",
                 f"{times['cuBLASLt raw'] / times['graphquant']:.2f}", f"{times['cuBLASLt per tensor'] / times['graphquant']:.2f}",
                 "graphquant" if planned == ours else "cuBLASLt"]
            )
    headers = ["m x n x k", *(f"{name} us" for name in fns), "planned cuBLASLt / graphquant", "raw / graphquant", "per tensor / graphquant",
               "the plan runs"]
    print(tabulate(rows, headers=headers))


if __name__ == "__main__":
    main()
