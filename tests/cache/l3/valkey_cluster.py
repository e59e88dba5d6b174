"""A real Valkey or Redis Cluster on loopback free ports, for tests: three
primaries with one replica each (`kvrelay.cache.l3.local_server`)."""

from __future__ import annotations

from pathlib import Path

from kvrelay.cache.l3.local_server import LocalCluster
from tests.cache.l3.valkey_server import server_binary


class ValkeyCluster(LocalCluster):
    def __init__(self, directory: Path, primaries: int = 3, replicas: int = 1) -> None:
        super().__init__(directory, primaries, replicas, server_binary())
