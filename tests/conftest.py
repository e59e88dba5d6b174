import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        # The marker, not `"gpu" in item.keywords`: keywords also hold the
        # names of parent folders, and a checkout under a folder named gpu
        # would skip the whole suite.
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
