"""benchmarks/decode_nvfp4.py on the CPU, its processes and kernels stood in for: a variant that
fails to compile is reported, and the run goes on to its table."""

import concurrent.futures
import os
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


class _InProcess:
    """A ProcessPoolExecutor that runs each task here, at once."""

    def __init__(self, *args, **kwargs):
        self._processes = {}

    def submit(self, fn, *args):
        future = concurrent.futures.Future()
        future.set_result(fn(*args))
        return future

    def shutdown(self, wait=True, cancel_futures=False):
        pass


def test_a_variant_that_fails_to_compile_is_reported_and_the_run_goes_on(monkeypatch, capsys):
    pytest.importorskip("triton")
    monkeypatch.syspath_prepend(BENCHMARKS)
    decode_nvfp4 = pytest.importorskip("decode_nvfp4")
    failing = decode_nvfp4.CANDIDATES[0][2]
    monkeypatch.setattr(decode_nvfp4.concurrent.futures, "ProcessPoolExecutor", _InProcess)
    monkeypatch.setattr(decode_nvfp4, "tasks_of", lambda cases: [("nvfp4", failing, cases)])
    monkeypatch.setattr(
        decode_nvfp4, "check", lambda task: [(("nvfp4", *case), task[1], None, "PassManager::run failed") for case in task[2]]
    )
    monkeypatch.setattr(sys, "argv", ["decode_nvfp4.py", "--rows", "1", "--weights", "64x64", "--budget", "1"])
    decode_nvfp4.main()
    out = capsys.readouterr().out
    assert f"FAILED ('nvfp4', (64, 64), 1) {decode_nvfp4.label(failing)}: PassManager::run failed" in out
    assert "format" in out.splitlines()[-2]  # the (empty) table's header
