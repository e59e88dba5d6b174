import pytest

from tests.cache.l3.valkey_cluster import ValkeyCluster
from tests.cache.l3.valkey_server import ValkeyServer
from tests.cache.server_process import ServerProcess


@pytest.fixture
def valkey_server(tmp_path):
    server = ValkeyServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def servers():
    started = []

    def start(*args, **kw):
        server = ServerProcess(*args, **kw)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def valkey_cluster(tmp_path_factory):
    """A real cluster of three primaries with a replica each, for a whole module
    (tests that kill a node restart it and wait for the cluster to settle)."""
    cluster = ValkeyCluster(tmp_path_factory.mktemp("valkey-cluster"))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
