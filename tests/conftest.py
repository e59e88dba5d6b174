from pathlib import Path

import pytest
import torch

# Folders whose tests start clusters, servers or rank processes: `make
# test-fast` (-m "not cluster and not slow") leaves them out.
CLUSTER_FOLDERS = {"bench", "cache", "chaos", "control", "demo", "integration", "serving",
                   "transfer"}  # fmt: skip
# Files elsewhere that spawn rank or CLI processes.
CLUSTER_FILES = {"test_cli.py", "test_context_parallel.py", "test_cross_config.py",
                 "test_parallel.py", "test_examples.py"}  # fmt: skip
TESTS = Path(__file__).parent


def _mark_cluster_tests(items) -> None:
    cluster = pytest.mark.cluster
    for item in items:
        parts = Path(item.path).relative_to(TESTS).parts if TESTS in Path(item.path).parents else ()
        if parts and (parts[0] in CLUSTER_FOLDERS or parts[-1] in CLUSTER_FILES):
            item.add_marker(cluster)


def pytest_collection_modifyitems(config, items):
    _mark_cluster_tests(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        # The marker, not `"gpu" in item.keywords`: keywords also hold the
        # names of parent folders, and a checkout under a folder named gpu
        # would skip the whole suite.
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture
def fake_clock():
    from tests.support.clock import FakeClock

    return FakeClock()
