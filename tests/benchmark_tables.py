"""Run a program of benchmarks/ as a user does, in a process of its own (its sibling modules,
such as benchmarks/models.py, are not the tests' of the same name), and read back its output or
its table."""

import pathlib
import re
import subprocess
import sys

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def output(program: str, argv: list[str]) -> str:
    """What ``python benchmarks/<program>.py ARGV`` printed, having succeeded."""
    run = subprocess.run([sys.executable, str(BENCHMARKS / f"{program}.py"), *argv], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def table_rows(program: str, argv: list[str]) -> tuple[dict[str, list[str]], str]:
    """The cells of the table ``python benchmarks/<program>.py ARGV`` printed, by their first
    (config) column, and its whole output (for assertion messages)."""
    out = output(program, argv)
    table = out[out.index("config "):].splitlines()[2:]
    return {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", line.strip()) for line in table)}, out
