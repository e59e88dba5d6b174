import os
from pathlib import Path

import pytest
import torch

# The HF oracle (tests/model) loads only local directories written by the
# tests: never ask the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Tiny models on a shared 2-core machine: torch's intra-op threads only
# contend with each other and with the other xdist worker (a speculative
# generate of a hidden-64 model took 2 s on one thread, 5-20 s on two, under
# load). The processes the tests start inherit the variable; rank processes
# set one thread themselves (kvrelay/model/parallel.py).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

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


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """`model_dirs(name, **overrides)`: the directory of a tiny model of
    `tests.support.models.TINY`, written once per pytest process."""
    from tests.support.models import ModelDirs

    return ModelDirs(tmp_path_factory.mktemp("models"))
