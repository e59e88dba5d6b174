"""L3 page stores behind one interface (`L3Store`): `file`, `valkey` and `valkey-cluster`.

Backends are imported lazily by `open_store`, so the `redis` client is only
needed where a valkey store is used.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from kvrelay.cache.l3.base import L3Stats, L3Store, check_key

__all__ = ["L3Stats", "L3Store", "check_key", "open_store"]


def open_store(url: str, *, capacity_bytes: int | None = None, **options) -> L3Store:
    """Open `file:DIR` (needs `capacity_bytes`), `valkey://HOST:PORT` (also `redis://`) or
    `valkey-cluster://HOST:PORT[,HOST:PORT...]` (also `redis-cluster://`)."""
    if url.startswith("file:"):
        from kvrelay.cache.l3.file import FileStore, FileStoreConfig

        if capacity_bytes is None:
            raise ValueError("a file store needs capacity_bytes")
        directory = url[len("file:") :]
        if directory.startswith("//"):
            directory = directory[2:]
        if not directory:
            raise ValueError(f"no directory in {url!r}")
        return FileStore(FileStoreConfig(Path(directory), capacity_bytes, **options))
    for scheme in ("valkey-cluster://", "redis-cluster://"):
        if url.startswith(scheme):
            from kvrelay.cache.l3.valkey_cluster import (
                ValkeyClusterStore,
                ValkeyClusterStoreConfig,
                parse_nodes,
            )

            nodes = parse_nodes(url[len(scheme) :])
            return ValkeyClusterStore(ValkeyClusterStoreConfig(nodes=nodes, **options))
    parts = urlsplit(url)
    if parts.scheme in ("valkey", "redis"):
        from kvrelay.cache.l3.valkey import ValkeyStore, ValkeyStoreConfig

        if not parts.hostname or parts.port is None:
            raise ValueError(f"{url!r} needs a host and a port")
        return ValkeyStore(ValkeyStoreConfig(host=parts.hostname, port=parts.port, **options))
    raise ValueError(
        f"unknown L3 store {url!r}: expected file:DIR, valkey://HOST:PORT "
        "or valkey-cluster://HOST:PORT[,HOST:PORT...]"
    )
