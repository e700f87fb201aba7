"""TFLOP/s of graphquant's GEMM backends beside bf16 torch.mm and raw torch._scaled_mm.

    python benchmarks/gemm.py

For each shape (m, n, k) of out = A @ B^T, every row is measured in the same run, alternating
over rounds; graphquant's rows include everything its gemm op does per call (scale layout,
dequantization for the emulated formats), on operands quantized beforehand.
"""

from __future__ import annotations

import sys

import torch
from tabulate import tabulate

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import alternate  # noqa: E402

from graphquant import backends  # noqa: E402
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
        # The raw row multiplies graphquant's own tensorwise operands: same bits, so the same
        # tensor-core power draw; the difference is what graphquant adds around the call.
        tw = Float8CurrentScalingQuantizer("e4m3")
        ta, tb = (tw(t, rowwise=True, columnwise=False).get(ROWWISE) for t in (a, b))
        fns = {
            "bf16 torch.mm": lambda: torch.mm(a, b.t()),
            "raw torch._scaled_mm tensorwise": lambda: torch._scaled_mm(
                ta.data, tb.data.t(), ta.scale, tb.scale, out_dtype=torch.bfloat16
            ),
        }
        reps = {}
        for name, (qa, qb) in FORMATS.items():
            ra = qa(a, rowwise=True, columnwise=False).get(ROWWISE)
            rb = qb(b, rowwise=True, columnwise=False).get(ROWWISE)
            reps[name] = backends.select(qa, ROWWISE, qb, ROWWISE, a.device, (m, n, k))
            fns[f"graphquant {name}"] = lambda ra=ra, rb=rb: backends.gemm(ra, rb, 1, torch.bfloat16)
        times = alternate(fns, rounds=3, inner=10)
        bf16, raw = times["bf16 torch.mm"], times["raw torch._scaled_mm tensorwise"]
        for name, ms in times.items():
            backend = reps[name.removeprefix("graphquant ")].backend if name.startswith("graphquant") else "torch"
            rows.append([f"{m}x{n}x{k}", name, backend, f"{ms:.3f}", f"{2 * m * n * k / ms / 1e9:.0f}", f"{ms / bf16:.2f}", f"{ms / raw:.3f}"])
    print(tabulate(rows, headers=["m x n x k", "GEMM", "backend", "ms", "TFLOP/s", "time / bf16", "time / raw fp8"]))


if __name__ == "__main__":
    main()
