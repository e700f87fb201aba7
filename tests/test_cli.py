"""python -m graphquant explain / numerics on models named MODULE:ATTR."""

import json
import os
import subprocess
import sys

import pytest
import torch

from graphquant.__main__ import load_recipe, main
from graphquant import Plan
from graphquant.recipes import CustomRecipe

TESTS = os.path.dirname(os.path.abspath(__file__))


def run_cli(*args):
    """The command line in a fresh process, run from the tests directory (where the models live)."""
    return subprocess.run(
        [sys.executable, "-m", "graphquant", *args], cwd=TESTS, capture_output=True, text=True, timeout=120
    )


def test_explain_prints_the_plan_table():
    result = run_cli("explain", "explain_models:mlp", "--recipe", "tensorwise", "--input-shape", "32,64")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "graphquant plan on cpu: 2 GEMM sites, 5 GEMMs (5 emulated)"
    assert [line.split()[:3] for line in lines[4:]] == [
        [site, "linear", gemm] for site in ("fc1#0", "fc2#0") for gemm in ("fprop", "dgrad", "wgrad") if (site, gemm) != ("fc1#0", "dgrad")
    ]  # the model's input needs no gradient: no dgrad of fc1 runs


def test_a_bad_recipe_name_fails_with_the_known_names():
    result = run_cli("explain", "explain_models:mlp", "--recipe", "fp8_everything", "--input-shape", "32,64")
    assert result.returncode == 1
    assert "unknown recipe 'fp8_everything'" in result.stderr and "mxfp8_fwd_nvfp4_bwd" in result.stderr


def test_inputs_the_model_cannot_take_fail_in_one_line_naming_their_shape():
    result = run_cli("explain", "explain_models:mlp", "--recipe", "tensorwise", "--input-shape", "4,10")
    assert result.returncode == 1
    assert result.stderr == (
        "error: explain_models:mlp fails on inputs of shape 4x10, without graphquant too: "
        "RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x10 and 64x128)\n"
    )


@pytest.fixture
def in_tests_dir(monkeypatch):
    monkeypatch.syspath_prepend(TESTS)


def test_a_model_object_a_preset_and_json(in_tests_dir, capsys):
    assert main(["explain", "explain_models:MODEL", "--recipe", "mxfp8_block_scaling", "--input-shape", "32,64", "--json"]) == 0
    plan = Plan.from_json(capsys.readouterr().out)
    assert {g.a_format for g in plan.gemms} == {"mxfp8(fp8_dtype=e4m3)"}


def test_a_factory_that_brings_its_inputs_and_a_factory_recipe(in_tests_dir, capsys):
    assert main(["explain", "explain_models:attention_with_inputs", "--recipe", "graphquant.factories:current_scaling_factory"]) == 0
    out = capsys.readouterr().out
    assert "matmul.1#0" in out and "fp8_current(fp8_dtype=e5m2)" in out


def test_dtype_casts_the_inputs_a_factory_brings_and_its_model(in_tests_dir, capsys, monkeypatch):
    """--dtype was applied to random inputs alone: a model bringing its own ran in its own dtype."""
    import graphquant.__main__ as cli

    ran = []
    monkeypatch.setattr(cli, "run", lambda command, spec, model, recipe, inputs: ran.append((model, inputs)) or Plan("cpu", (), ()))
    assert main(["explain", "explain_models:attention_with_inputs", "--recipe", "tensorwise", "--dtype", "bfloat16"]) == 0
    (model, inputs), = ran
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and {x.dtype for x in inputs} == {torch.bfloat16}


def test_numerics_prints_the_report(in_tests_dir, capsys):
    assert main(["numerics", "explain_models:mlp", "--recipe", "rowwise", "--input-shape", "32,64", "--dtype", "bfloat16"]) == 0
    assert capsys.readouterr().out.splitlines()[0].split()[:4] == ["site", "gemm", "SQNR", "dB"]


def test_numerics_of_a_model_returning_several_tensors_differentiates_their_sum(in_tests_dir, capsys):
    assert main(["numerics", "explain_models:with_outputs", "--recipe", "tensorwise", "--input-shape", "32,64", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["gemms"]
    every = {(s, g) for s in ("fc1#0", "fc2#0") for g in ("fprop", "dgrad", "wgrad")}
    assert {(g["site"], g["gemm"]) for g in rows} == every - {("fc1#0", "dgrad")}  # the input needs no gradient


def test_inputs_are_required_and_names_must_resolve(in_tests_dir, capsys):
    assert main(["explain", "explain_models:mlp", "--recipe", "tensorwise"]) == 1
    assert main(["explain", "explain_models:nothing", "--recipe", "tensorwise", "--input-shape", "4,64"]) == 1
    err = capsys.readouterr().err
    assert "give --input-shape" in err and "cannot load explain_models:nothing" in err


def test_recipe_names():
    assert isinstance(load_recipe("nvfp4_block_scaling"), CustomRecipe)
    assert load_recipe("deepseek_blockwise").qfactory.__name__ == "deepseek_blockwise_factory"
    assert load_recipe("graphquant.zoo:rowwise_factory").qfactory.__name__ == "rowwise_factory"
    assert load_recipe("graphquant.recipes:mxfp8_block_scaling").qfactory.__name__ == "mxfp8_factory"  # a preset, called


def test_a_recipe_of_the_wrong_type_fails_in_one_line(in_tests_dir, capsys):
    assert main(["explain", "explain_models:mlp", "--recipe", "graphquant:MXFP8Quantizer", "--input-shape", "32,64"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: graphquant needs a CustomRecipe, got the class") and err.count("\n") == 1, err


def test_explain_in_inference_mode_plans_fprop_alone_where_rows_would_not_tile_a_backward(in_tests_dir, capsys):
    """33 tokens under MXFP8 tile no training backward (32-row columnwise blocks) but run in
    inference, which the command line could not ask for."""
    assert main(["explain", "explain_models:mlp", "--recipe", "mxfp8_block_scaling", "--input-shape", "33,64"]) == 1
    assert main(["explain", "explain_models:mlp", "--recipe", "mxfp8_block_scaling", "--input-shape", "33,64", "--mode", "inference", "--json"]) == 0
    assert {g.gemm for g in Plan.from_json(capsys.readouterr().out).gemms} == {"fprop"}


def test_a_model_name_that_gives_no_module_fails_in_one_line(in_tests_dir, capsys):
    assert main(["explain", "explain_models:NOT_A_MODEL", "--recipe", "tensorwise", "--input-shape", "4,64"]) == 1
    assert main(["explain", "explain_models:not_a_model", "--recipe", "tensorwise", "--input-shape", "4,64"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "error: explain_models:NOT_A_MODEL is of type int: name an nn.Module, or a function of no arguments returning one",
        "error: explain_models:not_a_model() returned an object of type int, not an nn.Module (or a tuple (model, example_inputs))",
    ]


def test_a_quantizer_named_as_the_recipe_fails_saying_what_a_recipe_is(in_tests_dir, capsys):
    assert main(["explain", "explain_models:mlp", "--recipe", "explain_models:A_QUANTIZER", "--input-shape", "4,64"]) == 1
    assert "a recipe picks a quantizer for every slot: CustomRecipe(factory) with a factory(role) that returns it" in capsys.readouterr().err
