import pytest

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
