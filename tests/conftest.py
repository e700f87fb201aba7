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
