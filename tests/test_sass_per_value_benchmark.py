"""benchmarks/sass_per_value.py, which compiles for sm_90 with no GPU: the grouped GEMM's MXFP8 and
NVFP4 decoding product runs the decode GEMM's programs, so its main loop multiplies on wgmma and
spends no more instructions a weight value than the dense decode GEMM's under the same tiling."""

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
    per_value = {(r[0], r[1].split()[0]): (float(r[3]), int(r[4]), int(r[5])) for r in rows}
    for fmt in ("mxfp8", "nvfp4"):
        (grouped, wgmma, mma_sync), (dense, _, _) = per_value[fmt, "grouped"], per_value[fmt, "dense"]
        assert wgmma > 0 and mma_sync == 0 and grouped <= dense * 1.02, run.stdout
