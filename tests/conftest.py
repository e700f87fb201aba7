import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """GPU tests skip, with a reason, where no CUDA device exists."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
