"""benchmarks/grouped_quantize.py's plumbing on the CPU (its kernels need a GPU): each round runs in
a process of its own with its programs' switches, and the table takes each operand's median over
rounds."""

import importlib
import json
import subprocess

from benchmark_tables import BENCHMARKS


def test_each_round_runs_its_program_in_a_process_of_its_own(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    benchmark = importlib.import_module("grouped_quantize")
    monkeypatch.setenv("GRAPHQUANT_REGISTER_TILE", "0")  # the caller's setting is not the round's
    runs = []

    def run(argv, env, **kwargs):
        runs.append((argv, env))
        return subprocess.CompletedProcess(argv, 0, stdout="a warning\n" + json.dumps({"rowwise": {"down x": 1.5}}) + "\n", stderr="")

    monkeypatch.setattr(benchmark.subprocess, "run", run)
    for program in ("generic", "register", "all"):
        assert benchmark.measure(program, ["rowwise"], 7) == {"rowwise": {"down x": 1.5}}
    (generic_argv, generic_env), (_, register_env), (all_argv, all_env) = runs
    assert generic_env["GRAPHQUANT_REGISTER_TILE"] == "0" and generic_env["GRAPHQUANT_ROW_STRIP"] == "0"
    assert "GRAPHQUANT_REGISTER_TILE" not in register_env and register_env["GRAPHQUANT_ROW_STRIP"] == "0"
    assert "GRAPHQUANT_REGISTER_TILE" not in all_env and "GRAPHQUANT_ROW_STRIP" not in all_env
    assert generic_argv[-5:] == ["--child", "--formats", "rowwise", "--reps", "7"] and generic_argv == all_argv


def test_the_table_takes_medians_over_rounds_and_totals_each_format(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    benchmark = importlib.import_module("grouped_quantize")
    rounds = {
        "generic": [{"rowwise": {"a": 2.0, "b": 1.0}}, {"rowwise": {"a": 4.0, "b": 1.0}}, {"rowwise": {"a": 3.0, "b": 9.0}}],
        "register": [{"rowwise": {"a": 1.0, "b": 1.0}}, {"rowwise": {"a": 1.5, "b": 0.5}}, {"rowwise": {"a": 2.0, "b": 0.5}}],
        "all": [{"rowwise": {"a": 1.0, "b": 0.25}}, {"rowwise": {"a": 1.0, "b": 0.25}}, {"rowwise": {"a": 1.0, "b": 0.25}}],
    }
    lines = benchmark.table(rounds).splitlines()
    cells = {line.split("|")[2].strip(): [c.strip() for c in line.split("|")[3:8]] for line in lines[2:]}
    assert cells == {
        "a": ["3.000", "1.500", "1.000", "2.00x", "3.00x"],
        "b": ["1.000", "0.500", "0.250", "2.00x", "4.00x"],
        "all": ["4.000", "2.000", "1.250", "2.00x", "3.20x"],
    }
