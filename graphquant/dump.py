"""Graph dumps: for every graph graphquant compiles, what Dynamo captured, what graphquant
rewrote it into, and the plan, as files a person can read and diff.

Each graph gets the next free number in the directory, so several graphs, recompiles and runs
that share a directory never overwrite each other:

    graph_000_captured.py   the Dynamo graph as Python, before any rewrite
    graph_000_rewritten.py  the same graph with every GEMM a graphquant.ops.functional call whose
                            Site spells out the formats
    graph_000_plan.txt      the plan table
    graph_000_plan.json     the plan as JSON (Plan.from_json reads it back)

A graph whose plan graphquant refuses gets its captured graph and the refusal instead:

    graph_000_captured.py   as above
    graph_000_refused.txt   the error a call of the graph raises
"""

from __future__ import annotations

import itertools
import os

from torch import fx

from graphquant.passes.plan import Plan


def dump_graph(dump_dir: str, captured: str, gm: fx.GraphModule, plan: Plan) -> str:
    """Write one graph's four files into ``dump_dir``; returns their common path prefix."""
    prefix, number = _claim(dump_dir)
    return _write(prefix, {
        "captured.py": _captured(number, captured),
        "rewritten.py": f"# graphquant graph {number}: rewritten, GEMMs quantized\n{_tidy(gm.code)}",
        "plan.txt": f"{plan}\n",
        "plan.json": plan.to_json() + "\n",
    })


def dump_refusal(dump_dir: str, captured: str, error: Exception) -> str:
    """Write a refused graph's captured code and the refusal into ``dump_dir``, so that the graph
    the error is about can be read; returns their common path prefix."""
    prefix, number = _claim(dump_dir)
    return _write(prefix, {"captured.py": _captured(number, captured), "refused.txt": f"{type(error).__name__}: {error}\n"})


def _captured(number: str, code: str) -> str:
    return f"# graphquant graph {number}: as Dynamo captured it\n{_tidy(code)}"


def _write(prefix: str, files: dict[str, str]) -> str:
    for suffix, text in files.items():
        with open(f"{prefix}_{suffix}", "w") as f:
            f.write(text)
    return prefix


def _tidy(code: str) -> str:
    """Graph code without the blank lines around it and the spaces FX leaves at line ends."""
    return "\n".join(line.rstrip() for line in code.strip().splitlines()) + "\n"


def _claim(dump_dir: str) -> tuple[str, str]:
    """The first graph_NNN prefix not taken yet, taken atomically (processes may share the dir),
    and its number."""
    os.makedirs(dump_dir, exist_ok=True)
    for index in itertools.count():
        prefix = os.path.join(dump_dir, f"graph_{index:03d}")
        try:
            open(f"{prefix}_captured.py", "x").close()
        except FileExistsError:
            continue
        return prefix, f"{index:03d}"
