import pytest

from tests.cache.l3.valkey_server import ValkeyServer


@pytest.fixture
def valkey_server(tmp_path):
    server = ValkeyServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()
