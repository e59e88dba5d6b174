"""A real Valkey or Redis server on a free loopback port, for tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvrelay.cache.l3.local_server import LocalServer, find_server_binary, free_port

__all__ = ["ValkeyServer", "free_port", "server_binary"]


def server_binary() -> str:
    """The server binary; skipped outside CI when none is installed, a failure in CI."""
    path = find_server_binary()
    if path:
        return path
    message = (
        "no valkey-server or redis-server on PATH "
        "(apt-get install -y redis-server; .ci/run installs it)"
    )
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


class ValkeyServer(LocalServer):
    def __init__(self, directory: Path) -> None:
        super().__init__(directory, server_binary())
