"""benchmarks/generate.py on the CPU with its tiny model: every configuration generates, the table
has a row each, and frozen models hold fewer weight bytes and generate their per-call model's tokens."""

import pytest

from benchmark_tables import table_rows

pytest.importorskip("transformers")


@pytest.mark.slow
def test_tiny_generation_table():
    names = ["bf16 torch.compile", "graphquant tensorwise", "graphquant tensorwise frozen", "graphquant nvfp4 frozen"]
    rows, out = table_rows("generate", ["--tiny", "--device", "cpu", "--batch", "1,2", "--prompt", "8", "--new-tokens", "3",
                                        "--rounds", "1", "--configs", ",".join(names)])
    assert sorted(rows) == sorted(names), out
    for name, row in rows.items():
        assert all(float(v.split()[0]) > 0 for v in row[:5]), (name, row)  # tok/s @1, @2, weights, first generations
        assert all(v.endswith("x)") for v in row[:2]), (name, row)  # tok/s beside its ratio to bf16's
        if name.endswith(" frozen"):
            assert float(row[2]) < 0.65 * float(rows["bf16 torch.compile"][2]), out  # weight GiB
    assert rows["bf16 torch.compile"][:2] == [v.split()[0] + " (1.000x)" for v in rows["bf16 torch.compile"][:2]], out
    assert rows["graphquant tensorwise frozen"][5] == "yes", out  # its per-call model's tokens
