"""The `valkey` L3 store: pages as binary values in a Valkey or Redis server.

This is the shared L3 when cache servers span machines: any server can read a
page another demoted. Values are checked records (`record.py`). Capacity and
eviction are the server's (`maxmemory` with `allkeys-lru`), since several
cache servers share it.

A page is the value `<prefix><namespace hex>:<key>` (the key as 32 raw
bytes), so flushing one tenant is a SCAN for its prefix and UNLINKs, even for
pages no cache server indexes any more.

A store that is down or slow must not fail requests: every call runs with a
short socket timeout and no retries, and a failure answers a miss (or "not
stored") and keeps the store off for `backoff_s`, so a dead server costs one
timeout per back-off period rather than one per page.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvrelay.cache.l3 import record
from kvrelay.cache.l3.base import L3Store, check_key


@dataclass(frozen=True, slots=True)
class ValkeyStoreConfig:
    host: str = "127.0.0.1"
    port: int = 6379
    # Distinguishes kvrelay's keys from anything else in a shared server.
    prefix: bytes = b"kvrelay:page:"
    timeout_s: float = 0.25
    backoff_s: float = 1.0
    # Expire pages after this many seconds (None: only the server's eviction).
    ttl_s: int | None = None
    max_connections: int = 16


class ValkeyStore(L3Store):
    name = "valkey"

    def __init__(self, config: ValkeyStoreConfig) -> None:
        super().__init__()
        self.config = config
        pool = redis.ConnectionPool(
            host=config.host,
            port=config.port,
            socket_timeout=config.timeout_s,
            socket_connect_timeout=config.timeout_s,
            retry=Retry(NoBackoff(), 0),
            max_connections=config.max_connections,
        )
        self._client = redis.Redis(connection_pool=pool)
        self._lock = threading.Lock()
        self._down_until = 0.0

    def _name(self, key: bytes, namespace: bytes) -> bytes:
        check_key(key)
        return self._ns_prefix(namespace) + key

    def _ns_prefix(self, namespace: bytes) -> bytes:
        return self.config.prefix + record.normalize_namespace(namespace).hex().encode() + b":"

    def _available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self) -> None:
        with self._lock:
            self.stats.errors += 1
            self._down_until = time.monotonic() + self.config.backoff_s
        # Connections of a dead or stuck server are useless; start afresh.
        self._client.connection_pool.disconnect()

    def put(self, key: bytes, page: bytes | memoryview, namespace: bytes = b"") -> bool:
        name = self._name(key, namespace)
        if not self._available():
            return False
        try:
            self._client.set(name, record.encode(key, page, namespace), ex=self.config.ttl_s)
        except (redis.RedisError, OSError):
            self._failed()
            return False
        self.stats.puts += 1
        self.stats.bytes_in += len(page)
        return True

    def get(self, key: bytes, namespace: bytes = b"") -> bytes | None:
        return self.get_many([key], namespace)[0]

    def get_many(self, keys: Sequence[bytes], namespace: bytes = b"") -> list[bytes | None]:
        names = [self._name(key, namespace) for key in keys]
        self.stats.gets += len(keys)
        if not names or not self._available():
            return [None] * len(keys)
        try:
            blobs = self._client.mget(names)
        except (redis.RedisError, OSError):
            self._failed()
            return [None] * len(keys)
        pages: list[bytes | None] = []
        corrupt = []
        for key, blob in zip(keys, blobs, strict=True):
            page = None if blob is None else record.decode(key, blob, namespace)
            if blob is not None and page is None:
                corrupt.append(key)
            pages.append(None if page is None else bytes(page))
            if page is not None:
                self.stats.hits += 1
                self.stats.bytes_out += len(page)
        for key in corrupt:
            self.stats.checksum_failures += 1
            self.delete(key, namespace)
        return pages

    def delete(self, key: bytes, namespace: bytes = b"") -> bool:
        name = self._name(key, namespace)
        if not self._available():
            return False
        try:
            return bool(self._client.delete(name))
        except (redis.RedisError, OSError):
            self._failed()
            return False

    def flush(self, namespace: bytes | None = None) -> int:
        """SCAN for the namespace's names (every kvrelay page with None) and UNLINK them
        in batches; return how many went. A failure midway stops with what was done."""
        prefix = self.config.prefix if namespace is None else self._ns_prefix(namespace)
        pattern = glob_escape(prefix) + b"*"
        removed = 0
        if not self._available():
            return 0
        try:
            batch: list[bytes] = []
            for name in self._client.scan_iter(match=pattern, count=1000):
                batch.append(name)
                if len(batch) >= 1000:
                    removed += self._client.unlink(*batch)
                    batch = []
            if batch:
                removed += self._client.unlink(*batch)
        except (redis.RedisError, OSError):
            self._failed()
        return removed

    def close(self) -> None:
        self._client.close()
        self._client.connection_pool.disconnect()


def glob_escape(text: bytes) -> bytes:
    """`text` matched literally in a SCAN MATCH pattern."""
    out = bytearray()
    for byte in text:
        if byte in b"*?[]\\":
            out += b"\\"
        out.append(byte)
    return bytes(out)
