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
CLUSTER_FOLDERS = {"bench", "cache", "chaos", "control", "demo", "integration", "multihost",
                   "serving", "transfer"}  # fmt: skip
# Files elsewhere that spawn rank or CLI processes.
CLUSTER_FILES = {"test_cli.py", "test_context_parallel.py", "test_cross_config.py",
                 "test_parallel.py", "test_examples.py", "test_mla_parallel.py"}  # fmt: skip
TESTS = Path(__file__).parent
# The longest files (minutes of processes each, CI's --durations), run first:
# with `--dist loadfile --no-loadscope-reorder` (the Makefile) a worker that
# finishes a file takes the next in collection order, so a long file taken
# last kept one worker busy for minutes while the other idled. The many
# short files come after and fill the gaps.
LONGEST_FIRST = (
    "model/test_parallel.py", "model/test_mla_parallel.py", "serving/test_workers.py",
    "integration/test_cluster.py", "integration/test_mla_cluster.py",
    "integration/test_demo.py", "model/test_speculative.py", "model/test_cli.py",
    "serving/test_context_parallel.py", "chaos/test_faults.py", "test_examples.py",
    "serving/test_draft_pages.py", "bench/test_transfer_bench.py",
    "serving/test_speculative_decode.py", "serving/test_write_back.py", "model/test_spec_cli.py",
    "cache/test_server.py", "serving/test_ucx_and_lifecycle.py", "model/test_context_parallel.py",
    "model/test_cross_config.py",
)  # fmt: skip


def _mark_cluster_tests(items) -> None:
    cluster = pytest.mark.cluster
    for item in items:
        parts = Path(item.path).relative_to(TESTS).parts if TESTS in Path(item.path).parents else ()
        if parts and (parts[0] in CLUSTER_FOLDERS or parts[-1] in CLUSTER_FILES):
            item.add_marker(cluster)


def _longest_first(items) -> None:
    """Reorders `items` (a file's tests stay together and in order)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def key(item) -> int:
        path = Path(item.path)
        if TESTS not in path.parents:
            return len(rank)
        return rank.get(path.relative_to(TESTS).as_posix(), len(rank))

    items.sort(key=key)


def pytest_collection_modifyitems(config, items):
    _mark_cluster_tests(items)
    _longest_first(items)
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
