"""benchmarks/sass_per_value.py, which compiles for sm_90 with no GPU: the grouped GEMM's MXFP8 and
NVFP4 decoding programs are the decode GEMM's, so each main loop (16-token tiles on wgmma, one
token a program on the FMA units, inline PTX decoding in both) spends no more instructions a
weight value than the dense decode GEMM's program of the same tiling; where K passes the last whole
chunk, the tiles take no more shared memory, so as many programs fit an SM, and NVFP4's main loop
costs about what whole tiles' does (its steps inside K unmasked; MXFP8's tiles keep the masked
loop, which ran faster on the H200: benchmarks/NOTES.md). The FP8 decode GEMM's program, decoding
nothing, multiplies its codes on wgmma in fewer instructions a weight value than either (its weight
tile copied 16 bytes at a time under the alignment Triton's JIT gives a launch)."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_grouped_decoding_loop_costs_what_the_decode_gemms_does():
    pytest.importorskip("triton")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sass_per_value.py")], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    rows = [re.split(r"\s{2,}", line.strip()) for line in run.stdout[run.stdout.index("format "):].splitlines()[2:]]
    cost = {(r[0], r[1]): (float(r[4]), int(r[5]), int(r[6])) for r in rows}
    shared = {(r[0], r[1]): int(r[7]) for r in rows}
    pairs = {
        "grouped, 16-token tiles (_expert_tiles_kernel)": ("dense, 16-row tiles (decode GEMM)", True),
        "grouped, one token a program (_expert_rows_kernel)": ("dense, one row (decode GEMM's FMA program)", False),
    }
    for fmt in ("mxfp8", "nvfp4"):
        for grouped, (dense, on_wgmma) in pairs.items():
            (per_value, wgmma, mma_sync), (dense_per_value, _, _) = cost[fmt, grouped], cost[fmt, dense]
            assert (wgmma > 0) == on_wgmma and mma_sync == 0 and per_value <= dense_per_value * 1.02, run.stdout
        tiles, masked = "grouped, 16-token tiles (_expert_tiles_kernel)", "grouped, 16-token tiles, K past the last whole chunk (masked)"
        assert shared[fmt, masked] <= shared[fmt, tiles], run.stdout
    assert cost["nvfp4", masked][0] <= cost["nvfp4", tiles][0] * 1.05, run.stdout
    for a in ("A's codes", "A quantized as loaded"):
        per_value, wgmma, _ = cost["fp8 tensorwise", f"dense, 16-row tiles (decode GEMM), {a}"]
        assert wgmma > 0 and per_value < min(cost[fmt, "dense, 16-row tiles (decode GEMM)"][0] for fmt in ("mxfp8", "nvfp4")), run.stdout
