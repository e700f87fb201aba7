"""TFLOP/s of graphquant's GEMM backends beside bf16 torch.mm and raw torch._scaled_mm.

    python benchmarks/gemm.py [--shapes 8192x8192x8192,...] [--gemms fprop,dgrad,wgrad] [--formats "fp8 rowwise,fp8 tensorwise"] [--emulated]

For each shape (m, n, k) of out = A @ B^T, every row is measured in the same run, alternating
over rounds; graphquant's rows include everything its gemm op does per call (scale layout,
transposed copies, dequantization for the emulated formats), on operands quantized beforehand,
for each of a linear's GEMMs asked (``--gemms``: their operands' directions; fprop by default).
Each format on cuBLASLt is also timed as the raw torch._scaled_mm call of the same GEMM, on the
same operands (for per-tensor FP8, graphquant's own cuBLASLt call with the algorithm it timed;
the table after the rows lists those choices); ``--emulated`` also times the emulated GEMM of
each format the plan runs natively.
"""

from __future__ import annotations

import argparse
import sys

import torch
from tabulate import tabulate

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import alternate, print_algorithm_choices  # noqa: E402

from graphquant.kernels import backends, scaled_mm  # noqa: E402
from graphquant.quantizers import (  # noqa: E402
    COLUMNWISE,
    ROWWISE,
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8RowwiseQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)

SHAPES = [(8192, 8192, 8192), (16384, 4096, 14336), (16384, 14336, 4096), (4096, 4096, 4096)]

FORMATS = {
    "fp8 tensorwise": (Float8CurrentScalingQuantizer("e4m3"), Float8CurrentScalingQuantizer("e4m3")),
    "fp8 rowwise": (Float8RowwiseQuantizer(), Float8RowwiseQuantizer()),
    "fp8 block 1x128 x 128x128": (Float8BlockQuantizer(block_scaling_dim=1), Float8BlockQuantizer(block_scaling_dim=2)),
    "mxfp8 (emulated on sm90)": (MXFP8Quantizer(), MXFP8Quantizer()),
    "nvfp4 (emulated on sm90)": (NVFP4Quantizer(), NVFP4Quantizer(with_2d_quantization=True)),
}


# (direction of A, direction of B) of a linear's GEMMs.
LAYOUTS = {"fprop": (ROWWISE, ROWWISE), "dgrad": (ROWWISE, COLUMNWISE), "wgrad": (COLUMNWISE, COLUMNWISE)}
EMULATION = backends.GemmBackend(backends.EMULATION)
ON_CUBLASLT = (scaled_mm.TENSORWISE, scaled_mm.ROWWISE_SCALED, scaled_mm.BLOCKWISE, scaled_mm.MXFP8, scaled_mm.NVFP4)


def operand(quantizer, values: torch.Tensor, direction: str):
    """``direction`` of a representation whose GEMM operand is ``values`` (rows, k): a columnwise
    one quantizes its transpose, stored as the source tensor is."""
    source = values if direction == ROWWISE else values.t().contiguous()
    return quantizer(source, rowwise=direction == ROWWISE, columnwise=direction == COLUMNWISE).get(direction)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join("x".join(map(str, shape)) for shape in SHAPES), help="m x n x k of each GEMM, comma-separated")
    parser.add_argument("--gemms", default="fprop", help="a linear's GEMMs whose operand directions to time, comma-separated")
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated")
    parser.add_argument("--emulated", action="store_true", help="also time the emulated GEMM where the plan runs a native one")
    args = parser.parse_args()
    rows = []
    for m, n, k in (map(int, shape.split("x")) for shape in args.shapes.split(",")):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        fns = {"bf16 torch.mm": lambda: torch.mm(a, b.t())}
        selections, raw_of = {}, {}
        for gemm in args.gemms.split(","):
            da, db = LAYOUTS[gemm]
            for name in args.formats.split(","):
                qa, qb = FORMATS[name]
                ra, rb = operand(qa, a, da), operand(qb, b, db)
                label = name if gemm == "fprop" else f"{name} {gemm}"
                selection = selections[label] = backends.select(qa, da, qb, db, a.device, (m, n, k))
                if args.emulated and selection.bucket == backends.NATIVE:
                    selections[f"{label} emulated"] = backends.Selection(backends.EMULATED, EMULATION)
                for run in (label, f"{label} emulated"):
                    if run in selections:
                        backend = selections[run].backend
                        fns[f"graphquant {run}"] = lambda ra=ra, rb=rb, backend=backend, site=run: backends.gemm(ra, rb, 1, torch.bfloat16, backend, site)
                if selection.backend.name in ON_CUBLASLT:
                    # The same call on the same operands, its scales laid out beforehand: what
                    # graphquant adds around torch._scaled_mm is the difference.
                    call, kwargs = scaled_mm.arguments(selection.backend.name, ra, rb, torch.bfloat16)
                    raw_of[label] = f"raw torch._scaled_mm, {label}"
                    fns[raw_of[label]] = lambda call=call, kwargs=kwargs: torch._scaled_mm(*call, **kwargs)
        times = alternate(fns, rounds=5, inner=10)
        bf16 = times["bf16 torch.mm"]
        for name, ms in times.items():
            fmt = name.removeprefix("graphquant ")
            backend = str(selections[fmt].backend) if name.startswith("graphquant") else "torch"
            versus_raw = f"{ms / times[raw_of[fmt]]:.3f}" if fmt in raw_of and name.startswith("graphquant") else ""
            rows.append([f"{m}x{n}x{k}", name, backend, f"{ms:.3f}", f"{2 * m * n * k / ms / 1e9:.0f}", f"{ms / bf16:.2f}", versus_raw])
    print(tabulate(rows, headers=["m x n x k", "GEMM", "backend", "ms", "TFLOP/s", "time / bf16", "time / its raw _scaled_mm"]))
    print_algorithm_choices()


if __name__ == "__main__":
    main()
