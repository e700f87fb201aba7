"""benchmarks/inference_sweep.py on the CPU with its tiny FFN: every configuration runs at every
row count, frozen models hold fewer weight bytes and compute their per-call model's outputs."""

import importlib.util
import pathlib
import re

import pytest

from reference import fresh_dynamo  # noqa: F401  (autouse)

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.slow
def test_tiny_sweep_table(capsys):
    spec = importlib.util.spec_from_file_location("inference_sweep", BENCHMARKS / "inference_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    sweep.main(["--tiny", "--rows", "1,16", "--rounds", "1"])
    out = capsys.readouterr().out
    table = out[out.index("config "):].splitlines()[2:]
    rows = {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", line.strip()) for line in table)}
    recipes = ("tensorwise", "rowwise", "deepseek_blockwise", "mxfp8", "nvfp4")
    assert sorted(rows) == sorted(["bf16 torch.compile", *(f"graphquant {r}{f}" for r in recipes for f in ("", " frozen"))]), out
    for name, (at_1, at_16, weights, first, next_rows, *same) in rows.items():
        assert all(float(cell.split()[0]) > 0 for cell in (at_1, at_16, weights, first, next_rows)), (name, out)
        if name.endswith(" frozen"):
            assert float(weights) < 0.65 * float(rows["bf16 torch.compile"][2]), out
            assert same == ["yes"], out  # its per-call model's outputs, bit for bit
