"""Run a program of benchmarks/ in this process and read back the table it printed."""

import importlib.util
import pathlib
import re

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def table_rows(program: str, argv: list[str], capsys) -> tuple[dict[str, list[str]], str]:
    """benchmarks/``program``.py's main(``argv``): its table's cells by the first (config) column,
    and its whole output (for assertion messages)."""
    spec = importlib.util.spec_from_file_location(program, BENCHMARKS / f"{program}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(argv)
    out = capsys.readouterr().out
    table = out[out.index("config "):].splitlines()[2:]
    return {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", line.strip()) for line in table)}, out
