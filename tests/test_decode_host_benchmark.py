"""benchmarks/decode_host.py on the CPU with its tiny FFN: each configuration's eager calls are
timed, and a profiled one prints its functions."""

import pytest

from benchmark_tables import table_rows


@pytest.mark.slow
def test_tiny_decode_host_table():
    configs = ["bf16 torch.compile", "graphquant tensorwise frozen"]
    rows, out = table_rows("decode_host", ["--tiny", "--calls", "3", "--configs", ",".join(configs), "--profile", configs[1]])
    assert sorted(rows) == sorted(configs), out
    assert all(float(host) > 0 for _, host in rows.values()), out
    assert "cProfile of 3 calls" in out and "function calls" in out, out
