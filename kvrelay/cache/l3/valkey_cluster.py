"""The `valkey-cluster` L3 store: pages in a Valkey or Redis Cluster.

The shared L3 for deployments past one machine: the cluster spreads pages
over its primaries by hash slot, keeps a replica of each, and promotes a
replica when a primary dies. Values are the same checked records as the
single-server store (`record.py`) under the same names,
`<prefix><namespace hex>:<key>`; a name's slot is CRC16 of the whole name
(raw key bytes may happen to contain a `{...}` hash tag, which only moves the
page to another, still deterministic, slot).

Reads and writes go through the cluster client's pipeline, which groups a
call's commands per primary and sends one batch to each. A namespace flush
runs SCAN and UNLINK on every primary directly.

Failover: a primary that dies takes its slots with it until the cluster
promotes its replica. Calls meanwhile fail, answer misses (or "not stored"),
and keep the store off for `backoff_s`; the client re-reads the slot map after
any failure, so the first call past the back-off reaches the new primary.
Writes acknowledged by a primary but not yet copied to its replica are lost in
a failover: those pages become misses. A wrong page cannot come back, since a
record names its key and namespace and carries a digest.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from kvrelay.cache.l3 import record
from kvrelay.cache.l3.base import L3Store, check_key
from kvrelay.cache.l3.valkey import glob_escape

_FLUSH_BATCH = 1000
# What a down, slow or reshaping cluster raises (RedisClusterException is no RedisError).
_FAILURES = (redis.RedisError, redis.exceptions.RedisClusterException, OSError)


def parse_nodes(text: str) -> tuple[tuple[str, int], ...]:
    """`host:port[,host:port...]` as (host, port) pairs; a clear error otherwise."""
    nodes = []
    for part in text.split(","):
        host, sep, port = part.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"cluster node {part!r} is not HOST:PORT")
        nodes.append((host.strip("[]"), int(port)))
    return tuple(nodes)


@dataclass(frozen=True, slots=True)
class ValkeyClusterStoreConfig:
    # Any reachable nodes: the client learns the rest from them.
    nodes: tuple[tuple[str, int], ...]
    prefix: bytes = b"kvrelay:page:"
    timeout_s: float = 0.25
    backoff_s: float = 0.5
    ttl_s: int | None = None
    max_connections: int = 16

    def __post_init__(self) -> None:
        if not self.nodes:
            raise ValueError("a cluster store needs at least one node")


class ValkeyClusterStore(L3Store):
    name = "valkey-cluster"

    def __init__(self, config: ValkeyClusterStoreConfig) -> None:
        super().__init__()
        self.config = config
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._client: RedisCluster | None = None

    def _cluster(self) -> RedisCluster | None:
        """The cluster client, connected on first use (a cluster down at start is
        a store that answers misses, not a server that fails to start)."""
        if self._client is not None:
            return self._client
        c = self.config
        try:
            self._client = RedisCluster(
                startup_nodes=[ClusterNode(host, port) for host, port in c.nodes],
                socket_timeout=c.timeout_s,
                socket_connect_timeout=c.timeout_s,
                retry=Retry(NoBackoff(), 0),
                # Slots of a dead primary are misses until its replica takes over.
                require_full_coverage=False,
                max_connections=c.max_connections,
            )
        except _FAILURES:
            self._failed()
        return self._client

    def _name(self, key: bytes, namespace: bytes) -> bytes:
        check_key(key)
        return self._ns_prefix(namespace) + key

    def _ns_prefix(self, namespace: bytes) -> bytes:
        return self.config.prefix + record.normalize_namespace(namespace).hex().encode() + b":"

    def _usable(self) -> RedisCluster | None:
        if time.monotonic() < self._down_until:
            return None
        return self._cluster()

    def _failed(self) -> None:
        with self._lock:
            self.stats.errors += 1
            self._down_until = time.monotonic() + self.config.backoff_s

    def _run(self, commands: Sequence[tuple]) -> list | None:
        """Run `commands` in one cluster pipeline (a batch per primary); a reply per
        command, an exception in place of a failed one; None when the store is off
        or the whole batch failed."""
        client = self._usable()
        if client is None or not commands:
            return None
        try:
            with client.pipeline() as pipe:
                for command in commands:
                    pipe.execute_command(*command)
                return pipe.execute(raise_on_error=False)
        except _FAILURES:
            self._failed()
            return None

    def put(self, key: bytes, page: bytes | memoryview, namespace: bytes = b"") -> bool:
        name = self._name(key, namespace)
        command = ("SET", name, record.encode(key, page, namespace))
        if self.config.ttl_s is not None:
            command += ("EX", self.config.ttl_s)
        replies = self._run([command])
        if replies is None or isinstance(replies[0], Exception):
            if replies is not None:
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
        replies = self._run([("GET", name) for name in names])
        if replies is None:
            return [None] * len(keys)
        pages: list[bytes | None] = []
        corrupt = []
        failed = False
        for key, blob in zip(keys, replies, strict=True):
            if isinstance(blob, Exception):
                failed = True
                blob = None
            page = None if blob is None else record.decode(key, blob, namespace)
            if blob is not None and page is None:
                corrupt.append(key)
            pages.append(None if page is None else bytes(page))
            if page is not None:
                self.stats.hits += 1
                self.stats.bytes_out += len(page)
        if failed:
            self._failed()
        for key in corrupt:
            self.stats.checksum_failures += 1
            self.delete(key, namespace)
        return pages

    def delete(self, key: bytes, namespace: bytes = b"") -> bool:
        replies = self._run([("UNLINK", self._name(key, namespace))])
        return replies is not None and replies[0] == 1

    def flush(self, namespace: bytes | None = None) -> int:
        """SCAN each primary for the namespace's names (every kvrelay page with None)
        and UNLINK them in batches on that primary; return how many went. A primary
        that fails stops its own part; the others still flush."""
        prefix = self.config.prefix if namespace is None else self._ns_prefix(namespace)
        pattern = glob_escape(prefix) + b"*"
        client = self._usable()
        if client is None:
            return 0
        removed = 0
        try:
            primaries = client.get_primaries()
        except _FAILURES:
            self._failed()
            return 0
        for node in primaries:
            try:
                removed += _flush_node(client.get_redis_connection(node), pattern)
            except _FAILURES:
                self._failed()
        return removed

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def _flush_node(node: redis.Redis, pattern: bytes) -> int:
    """UNLINK every name matching `pattern` on one node: one key per UNLINK (names
    of different slots cannot share a command), a pipeline per batch."""
    removed = 0
    batch: list[bytes] = []

    def unlink() -> int:
        with node.pipeline(transaction=False) as pipe:
            for name in batch:
                pipe.unlink(name)
            return sum(int(n) for n in pipe.execute())

    for name in node.scan_iter(match=pattern, count=_FLUSH_BATCH):
        batch.append(name)
        if len(batch) >= _FLUSH_BATCH:
            removed += unlink()
            batch = []
    if batch:
        removed += unlink()
    return removed
