"""graphquant's CUDA FP8 grouped GEMM beside copies of it from other revisions, in alternating
rounds on grouped_gemm.py's operands, and whether their outputs are the same bits.

    mkdir -p base && for f in grouped_gemm.cu hopper.cuh; do git show REV:csrc/cuda/$f > base/$f; done
    python benchmarks/grouped_gemm_ab.py --baselines base[,other] [--formats rowwise,deepseek_blockwise]
        [--sites gate_up,down] [--rounds 5]

Each folder's grouped_gemm.cu (with the hopper.cuh beside it) is built alone as an extension of its
own with setup.py's nvcc flags for sm_90a, the folders in parallel (about 90 s); "now" is the
installed extension's kernel. On the GPU machine, which has no git, the folders travel as ignored
paths (run's ``carry``). "Same bits": each baseline's output against now's, in bf16, fp16 and fp32,
at the site's width and at one 3 narrower (the tiles' partial edge).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import sys
import types

import torch
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(__file__))
import grouped_gemm  # noqa: E402
from common import alternate  # noqa: E402

from graphquant.formats import groups  # noqa: E402
from graphquant.kernels import grouped_fp8  # noqa: E402
from graphquant.quantizers import ROWWISE  # noqa: E402

# setup.py's nvcc flags (the kernels' bits need IEEE division, subnormals and no contracted FMAs), for sm_90a alone.
NVCC_FLAGS = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-prec-div=true", "-ftz=false", "-fmad=false",
              "-gencode=arch=compute_90a,code=sm_90a"]
BINDING = """#include <torch/extension.h>
void register_grouped_gemm(pybind11::module_& m);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { register_grouped_gemm(m); }
"""


def built(folder: str):
    """``folder``/grouped_gemm.cu as an extension module of its own."""
    from torch.utils import cpp_extension

    binding = os.path.join(folder, "binding.cpp")
    with open(binding, "w") as f:
        f.write(BINDING)
    name = "grouped_gemm_" + "".join(c if c.isalnum() else "_" for c in os.path.abspath(folder))
    return cpp_extension.load(name, [binding, os.path.join(folder, "grouped_gemm.cu")], extra_cuda_cflags=NVCC_FLAGS,
                              extra_include_paths=[folder])


def _build_only(folder: str) -> None:
    built(folder)  # a module does not pickle back to the pool; the parent loads it from the build cache


@contextlib.contextmanager
def running(extension):
    """grouped_fp8's functions calling ``extension``'s kernel, None: the installed one's."""
    installed = grouped_fp8.native
    if extension is not None:
        grouped_fp8.native = types.SimpleNamespace(extension_for=lambda device: extension)
    try:
        yield
    finally:
        grouped_fp8.native = installed


def product(extension, a, b, b_group, tokens, width: int, out_dtype: torch.dtype) -> torch.Tensor:
    with running(extension):
        if a.direction == ROWWISE:
            return grouped_fp8.tokens_by_experts(a, b, b_group, tokens, groups.GROUP_ROWS, width, out_dtype, grouped_fp8.PROMOTE_EVERY)
        return grouped_fp8.tokens_by_tokens(a, tokens.row_group, b, b_group, tokens.ends, width, out_dtype, grouped_fp8.PROMOTE_EVERY)


def _same(x: torch.Tensor, y: torch.Tensor) -> bool:
    bits = {2: torch.int16, 4: torch.int32}[x.element_size()]
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.view(bits), y.view(bits))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baselines", required=True, help="comma-separated folders, each a grouped_gemm.cu and its hopper.cuh")
    parser.add_argument("--formats", default="rowwise,deepseek_blockwise")
    parser.add_argument("--sites", default="gate_up,down")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    args = parser.parse_args()
    folders = args.baselines.split(",")
    with multiprocessing.get_context("spawn").Pool(len(folders)) as pool:
        pool.map(_build_only, folders)
    sides = {**{folder: built(folder) for folder in folders}, "now": None}
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    offs, tokens = grouped_gemm.routed()
    rows = grouped_gemm.TOKENS * grouped_gemm.TOP_K
    table = []
    for site in args.sites.split(","):
        k, n = grouped_gemm.SITES[site]
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(grouped_gemm.EXPERTS, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        dy = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
        for name in args.formats.split(","):
            for gemm, (a, b, b_group, width) in grouped_gemm.operands(name, x, w, dy, tokens).items():
                same = {
                    folder: all(
                        _same(product(extension, a, b, b_group, tokens, width - cut, dtype), product(None, a, b, b_group, tokens, width - cut, dtype))
                        for dtype in (torch.bfloat16, torch.float16, torch.float32) for cut in (0, 3)
                    )
                    for folder, extension in sides.items() if extension is not None
                }
                fns = {side: (lambda e=extension: product(e, a, b, b_group, tokens, width, torch.bfloat16)) for side, extension in sides.items()}
                ms = alternate(fns, rounds=args.rounds, warmup=1, reps=5, queued=1)
                table.append([site, gemm, name, *(f"{ms[side]:.3f}" for side in sides),
                              *(f"{ms[folder] / ms['now']:.3f}x" for folder in folders), ", ".join(f"{f}: {same[f]}" for f in folders)])
                print(" | ".join(table[-1]), flush=True)
    headers = ["site", "GEMM", "format", *(f"{side} ms" for side in sides), *(f"now x {f}" for f in folders), "same bits"]
    print(tabulate(table, headers=headers, tablefmt="simple", disable_numparse=True))


if __name__ == "__main__":
    main()
