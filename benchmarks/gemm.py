"""TFLOP/s of graphquant's GEMM backends beside bf16 torch.mm and raw torch._scaled_mm.

    python benchmarks/gemm.py

For each shape (m, n, k) of out = A @ B^T, every row is measured in the same run, alternating
over rounds; graphquant's rows include everything its gemm op does per call (scale layout,
dequantization for the emulated formats), on operands quantized beforehand. Each native format
is also timed as the raw torch._scaled_mm call of the same GEMM, on the same operands (for
per-tensor FP8, graphquant's own cuBLASLt call with the algorithm it timed; the table after the
rows lists those choices).
"""

from __future__ import annotations

import sys

import torch
from tabulate import tabulate

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import alternate, print_algorithm_choices  # noqa: E402

from graphquant.kernels import backends, scaled_mm  # noqa: E402
from graphquant.quantizers import (  # noqa: E402
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


def main() -> None:
    rows = []
    for m, n, k in SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        fns = {"bf16 torch.mm": lambda: torch.mm(a, b.t())}
        selections, raw_of = {}, {}
        for name, (qa, qb) in FORMATS.items():
            ra = qa(a, rowwise=True, columnwise=False).get(ROWWISE)
            rb = qb(b, rowwise=True, columnwise=False).get(ROWWISE)
            selection = selections[name] = backends.select(qa, ROWWISE, qb, ROWWISE, a.device, (m, n, k))
            fns[f"graphquant {name}"] = lambda ra=ra, rb=rb, backend=selection.backend, site=name: backends.gemm(
                ra, rb, 1, torch.bfloat16, backend, site
            )
            if selection.bucket == backends.NATIVE:
                # The same call on the same operands, its scales laid out beforehand: what
                # graphquant adds around torch._scaled_mm is the difference.
                args, kwargs = scaled_mm.arguments(selection.backend.name, ra, rb, torch.bfloat16)
                raw_of[name] = f"raw torch._scaled_mm, {name}"
                fns[raw_of[name]] = lambda args=args, kwargs=kwargs: torch._scaled_mm(*args, **kwargs)
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
