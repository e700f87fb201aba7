"""benchmarks/inference_sweep.py on the CPU with its tiny FFN and MoE layer: every configuration
runs at every row count, frozen models (expert stacks included) hold fewer weight bytes and
compute their per-call model's outputs."""

import pytest

from benchmark_tables import table_rows

RECIPES = ("tensorwise", "rowwise", "deepseek_blockwise", "mxfp8", "nvfp4")


@pytest.mark.slow
@pytest.mark.parametrize("model", ["ffn", "moe"])
def test_tiny_sweep_table(model):
    rows, out = table_rows("inference_sweep", ["--tiny", "--model", model, "--rows", "1,16", "--rounds", "1"])
    assert sorted(rows) == sorted(["bf16 torch.compile", *(f"graphquant {r}{f}" for r in RECIPES for f in ("", " frozen"))]), out
    for name, (at_1, at_16, weights, first, next_rows, *same) in rows.items():
        assert all(float(cell.split()[0]) > 0 for cell in (at_1, at_16, weights, first, next_rows)), (name, out)
        if name.endswith(" frozen"):
            # The tiny MoE's experts (hidden 64) are stored padded to 128 rows each, and its stand-ins
            # hold one expert of each of 4; test_freeze_experts pins the stored bytes of whole blocks.
            bound = 0.65 if model == "ffn" else 1.0
            assert float(weights) < bound * float(rows["bf16 torch.compile"][2]), out
            assert same == ["yes"], out  # its per-call model's outputs, bit for bit
