"""benchmarks/generate.py on the CPU with its tiny model: every configuration generates, the table
has a row each, and frozen models hold fewer weight bytes and generate their per-call tokens."""

import importlib.util
import pathlib
import re

import pytest

from reference import fresh_dynamo  # noqa: F401  (autouse)

pytest.importorskip("transformers")
BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.slow
def test_tiny_generation_table(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("generate", BENCHMARKS / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    generate.main(["--tiny", "--device", "cpu", "--batch", "1,2", "--prompt", "8", "--new-tokens", "3", "--rounds", "1"])
    out = capsys.readouterr().out
    table = out[out.index("config "):].splitlines()[2:]
    rows = {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", line.strip()) for line in table)}
    names = ["bf16 torch.compile", *(f"graphquant {r}{f}" for r in ("tensorwise", "rowwise", "mxfp8", "nvfp4") for f in ("", " frozen"))]
    assert sorted(rows) == sorted(names), out
    for name, row in rows.items():
        assert all(float(v) > 0 for v in row[:5]), (name, row)  # tok/s @1, @2, weights, first generations
        if name.endswith(" frozen"):
            per_call = rows[name.removesuffix(" frozen")]
            assert row[5] == "yes", out
            assert float(row[2]) < 0.65 * float(per_call[2]), out
