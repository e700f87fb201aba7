"""benchmarks/first_call.py on the CPU (Inductor's C++ backend): one report a row count, each the
seconds and compile phases of that call alone, the later call compiling its shape's own graph."""

import re

import pytest

from benchmark_tables import output


@pytest.mark.slow
def test_a_report_for_each_row_count():
    out = output("first_call", ["graphquant tensorwise frozen", "--tiny", "--rows", "16,32", "--top", "3"])
    calls = re.findall(r"graphquant tensorwise frozen, no_grad: 1 SwiGLU FFN blocks \(128 -> 256 -> 128\), (\d+) rows on cpu, .*: first call ([\d.]+) s", out)
    assert [rows for rows, _ in calls] == ["16", "32"] and all(float(s) > 0 for _, s in calls), out
    # The counters start again at each call: the second compiles one graph of its own, no graph break.
    graphs = re.findall(r"Dynamo counters: .*'unique_graphs': (\d+)", out)
    assert graphs == ["1", "1"] and "'graph_break': {}" in out, out
    assert len(re.findall(r"Inductor kernels generated: [1-9]", out)) == 2, out
