import os

import pytest

# The tests' tensors are small, so a second intra-op thread gains little, and where the other
# core is busy (a shared machine, another pytest-xdist worker) OpenMP's threads spin waiting for
# each other. OMP_NUM_THREADS, where set, wins; processes the tests start inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # also where torch was imported first


def pytest_collection_modifyitems(config, items):
    """GPU tests skip, with a reason, where no CUDA device exists."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _capabilities_asked_afresh():
    """Tests fake GPUs by patching torch.cuda.get_device_capability: each asks anew, not what
    graphquant.kernels.devices kept from an earlier test."""
    from graphquant.kernels import devices

    devices._of.cache_clear()


@pytest.fixture(autouse=True)
def _split_counters_left_zero():
    """Every K-split GEMM launch (the decode GEMM's, the mixed-input GEMM's) on a stream that runs
    eagerly (CPU, a CUDA device's default stream) leaves its arrival counters at zero
    (graphquant.kernels.arrival_counters): a count left over would make the next split launch on
    that stream add partial sums not yet written, in whichever test runs next: this names the test
    that left them so."""
    yield
    from graphquant.kernels import arrival_counters

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    left = [(key, counters) for key, counters in arrival_counters.COUNTERS.items() if key[1] in (None, 0) and bool(counters.any())]
    for _, counters in left:
        counters.zero_()  # so that this test alone is reported, not every one after it
    assert not left, f"K-split GEMM launches left arrival counters non-zero on {[key for key, _ in left]}: the next K-split launch there adds partial sums not yet written"
