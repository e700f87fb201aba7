"""benchmarks/grouped_decode.py on the CPU at its tiny dims: each way of the emulated expert
product runs (the decoding kernel under Triton's interpreter, patched as the kernel tests patch
it) and the three ways' outputs agree to fp32 accumulation order."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROGRAM = f"""
import runpy, sys
sys.path.insert(0, {str(ROOT / "tests")!r})
import triton_interpreter
triton_interpreter.as_on_the_gpu()
sys.argv = ["grouped_decode.py", "--tiny"]
runpy.run_path({str(ROOT / "benchmarks" / "grouped_decode.py")!r}, run_name="__main__")
"""


@pytest.mark.slow
def test_tiny_grouped_decode_table():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    table = run.stdout[run.stdout.index("format "):].splitlines()[2:]
    rows = [re.split(r"\s{2,}", line.strip()) for line in table]
    formats, products = ("mxfp8_block_scaling", "nvfp4_block_scaling"), ("gate and up", "down")
    assert [tuple(r[:3]) for r in rows] == [(f, p, rows_) for f in formats for p in products for rows_ in ("8", "64")], run.stdout
    assert all(float(r[-1]) <= 1e-5 for r in rows), run.stdout
