"""examples/train_tiny_llama.py, shortened: it trains, prints the plan and the loss table, and
checks its own result (the checks can fail)."""

import importlib.util
import math
import pathlib
import sys

import pytest
import torch

from reference import fresh_dynamo  # noqa: F401  (autouse)

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_tiny_llama.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("train_tiny_llama", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


# The example as it runs by default (Inductor, its own sizes) compiles C++ kernels for minutes on
# a cold cache; the quick run takes the same steps through aot_eager with a quarter of the tokens.
@pytest.mark.parametrize(
    "options",
    [
        pytest.param(["--backend", "aot_eager", "--batch", "4", "--seq", "64"], id="aot_eager-small"),
        pytest.param([], id="defaults", marks=pytest.mark.slow),
    ],
)
def test_short_run_trains_and_reports(example, capsys, tmp_path, options):
    plot = tmp_path / "loss.png"
    code = example.main(["--steps", "20", "--log-every", "5", "--plot", str(plot), "--device", "cpu", *options])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "graphquant plan on cpu: 15 GEMM sites, 45 GEMMs" in out
    assert "layers.0.attn.q_proj#0" in out and "input.rowwise: mxfp8(fp8_dtype=e4m3)" in out
    table = out[out.index("step    baseline float32"):].splitlines()
    rows = [line.split() for line in table[2:6]]
    assert [r[0] for r in rows] == ["5", "10", "15", "20"]
    baseline, quantized = [float(r[1]) for r in rows], [float(r[2]) for r in rows]
    assert baseline[-1] < baseline[0] - 1 and quantized[-1] < quantized[0] - 1  # the loss fell
    assert abs(quantized[-1] - baseline[-1]) < example.MARGIN
    assert "OK: the loss fell" in out
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in out and not plot.exists()
    else:
        assert plot.stat().st_size > 0


def test_fp8_attention_option(example, capsys):
    """--fp8-attention quantizes attention too: a dpa site per layer in the plan, and it trains."""
    argv = ["--steps", "20", "--log-every", "5", "--plot", "", "--device", "cpu", "--backend", "aot_eager", "--batch", "4", "--seq", "64"]
    code = example.main([*argv, "--fp8-attention"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "graphquant plan on cpu: 17 GEMM sites, 57 GEMMs" in out
    assert "layers.1.attn#0" in out and "dS: dp.rowwise: fp8_delayed(fp8_dtype=e5m2" in out
    assert "OK: the loss fell and mxfp8_fwd_high_precision_bwd + fp8 attention ended within" in out


def test_the_checks_can_fail(example):
    names = ("baseline float32", "some recipe")
    ok = example.verdict((300, 2.27, 2.30), names, 0.05, 256)
    assert ok == []
    too_far = example.verdict((300, 2.27, 2.33), names, 0.05, 256)
    assert len(too_far) == 1 and "beyond the margin 0.05" in too_far[0]
    no_fall = example.verdict((300, 0.7 * math.log(256), 0.7 * math.log(256)), names, 0.05, 256)
    assert len(no_fall) == 2 and all("did not fall" in f for f in no_fall)


def test_runs_too_short_to_judge_say_so_instead_of_failing(example):
    """--steps 5 ends before the loss has left ln 256 behind: not judged (exit 0), with what to change."""
    assert example.not_judged(5, 25) == (
        "the last row averages steps 1-5, but the checks judge only a last row that begins at step 15 or later, "
        "past the first steep fall of the loss: run with more than 15 steps"
    )
    assert example.not_judged(20, 25).endswith("run with --log-every 5 or less")
    assert example.not_judged(20, 5) == example.not_judged(300, 25) == example.not_judged(26, 25) == ""


def test_every_recipe_name_is_accepted(example):
    from graphquant import zoo

    for name in [*example.PRESETS, *zoo.FACTORIES]:
        assert example.make_recipe(name).qfactory is not None
    with pytest.raises(SystemExit, match="unknown recipe"):
        example.make_recipe("fp3")


def test_corpus_is_plain_text_of_a_few_hundred_kilobytes(example):
    data = example.DATA.read_bytes()
    assert 200_000 < len(data) < 1_000_000
    assert data.decode("ascii").startswith("Genesis 1\nIn the beginning God created the heaven and the earth.")
    batches = example.batches(example.load_corpus(torch.device("cpu")), 3, 2, 16, seed=0)
    assert all(torch.equal(x[:, 1:], y[:, :-1]) for x, y in batches)  # targets are the next bytes
