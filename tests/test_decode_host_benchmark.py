"""benchmarks/decode_host.py on the CPU with its tiny FFN: each configuration's eager calls and
its calls with no compute are timed, and a profiled one prints its functions."""

import pytest

from benchmark_tables import table_rows


@pytest.mark.slow
def test_tiny_decode_host_table():
    configs = ["bf16 torch.compile", "graphquant tensorwise frozen"]
    rows, out = table_rows("decode_host", ["--tiny", "--calls", "3", "--configs", ",".join(configs), "--profile", configs[1]])
    assert sorted(rows) == sorted(configs), out
    assert all(len(cells) == 3 and all(float(us) > 0 for us in cells[1:]) for cells in rows.values()), out
    assert "cProfile of 3 calls" in out and "us a call under cProfile" in out and "function, by own time" in out, out
