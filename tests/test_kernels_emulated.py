"""The native-kernel tests of test_kernels_gpu.py, on the CPU build of the same CUDA kernels.

tests/emulation compiles csrc/cuda for the host and runs each CTA's phases thread by thread, so
the kernels' indexing, layouts and numerics are checked bit for bit where no GPU exists. Slow
(a C++ build, then every test), and skipped where no C++ toolchain can build it.
"""

import pytest

from emulation import extension
from graphquant.kernels import native
from test_kernels_gpu import *  # noqa: F401,F403  (the tests, run here with the backend below)

pytestmark = pytest.mark.slow


@pytest.fixture
def backend(monkeypatch):
    ext = extension()
    if ext is None:
        pytest.skip("no C++ compiler to build the emulated kernels")
    monkeypatch.setattr(native, "extension", lambda: ext)
    forbid_reference(monkeypatch)  # noqa: F405
    return "cpu"
