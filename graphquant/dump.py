"""Graph dumps: for every graph graphquant compiles, what Dynamo captured, what graphquant
rewrote it into, and the plan, as files a person can read and diff.

Each graph gets the next free number in the directory, so several graphs, recompiles and runs
that share a directory never overwrite each other:

    graph_000_captured.py   the Dynamo graph as Python, before any rewrite
    graph_000_rewritten.py  the same graph with every GEMM a graphquant.ops.functional call whose
                            Site spells out the formats
    graph_000_plan.txt      the plan table
    graph_000_plan.json     the plan as JSON (Plan.from_json reads it back)
"""

from __future__ import annotations

import itertools
import os

from torch import fx

from graphquant.passes.plan import Plan


def dump_graph(dump_dir: str, captured: str, gm: fx.GraphModule, plan: Plan) -> str:
    """Write one graph's four files into ``dump_dir``; returns their common path prefix."""
    os.makedirs(dump_dir, exist_ok=True)
    prefix = _claim(dump_dir)
    number = os.path.basename(prefix).removeprefix("graph_")
    files = {
        "captured.py": f"# graphquant graph {number}: as Dynamo captured it\n{_tidy(captured)}",
        "rewritten.py": f"# graphquant graph {number}: rewritten, GEMMs quantized\n{_tidy(gm.code)}",
        "plan.txt": f"{plan}\n",
        "plan.json": plan.to_json() + "\n",
    }
    for suffix, text in files.items():
        with open(f"{prefix}_{suffix}", "w") as f:
            f.write(text)
    return prefix


def _tidy(code: str) -> str:
    """Graph code without the blank lines around it and the spaces FX leaves at line ends."""
    return "\n".join(line.rstrip() for line in code.strip().splitlines()) + "\n"


def _claim(dump_dir: str) -> str:
    """The first graph_NNN prefix not taken yet, taken atomically (processes may share the dir)."""
    for index in itertools.count():
        prefix = os.path.join(dump_dir, f"graph_{index:03d}")
        try:
            open(f"{prefix}_captured.py", "x").close()
        except FileExistsError:
            continue
        return prefix
