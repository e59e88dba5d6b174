"""The valkey-cluster store against a real cluster of three primaries with a
replica each (started once for the module)."""

import hashlib
import subprocess
import threading
import time

import pytest
import redis
from redis.cluster import RedisCluster

from kvrelay.cache.l3 import open_store
from kvrelay.cache.l3.local_server import cli_binary
from kvrelay.cache.l3.record import HEADER_BYTES
from kvrelay.cache.l3.valkey_cluster import ValkeyClusterStore, parse_nodes
from tests.cache.l3.valkey_server import free_port

NS_A = hashlib.sha256(b"tenant a").digest()
NS_B = hashlib.sha256(b"tenant b").digest()


def key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest()


def page(i: int, size: int = 2048) -> bytes:
    return i.to_bytes(8, "little") * (size // 8)


@pytest.fixture
def store(valkey_cluster) -> ValkeyClusterStore:
    with open_store(valkey_cluster.url) as s:
        s.flush()
        yield s


def names_on(node, namespace: bytes) -> int:
    return sum(
        1
        for _ in node.client().scan_iter(match=b"kvrelay:page:" + namespace.hex().encode() + b":*")
    )


def test_parse_nodes():
    assert parse_nodes("a:1, [::1]:2") == (("a", 1), ("::1", 2))
    for bad in ["", "a", "a:", ":1", "a:b", "a:70000"]:
        with pytest.raises(ValueError):
            parse_nodes(bad)


def test_pages_spread_over_every_primary(valkey_cluster, store):
    assert all(store.put(key(i), page(i), NS_A) for i in range(120))
    primaries = valkey_cluster.primaries()
    assert len(primaries) == 3
    counts = [names_on(p, NS_A) for p in primaries]
    assert sum(counts) == 120 and min(counts) > 10
    # Stored as the single-server store's record under the same name.
    raw = RedisCluster(host="127.0.0.1", port=primaries[0].port)
    value = raw.get(b"kvrelay:page:" + NS_A.hex().encode() + b":" + key(3))
    assert value.endswith(page(3)) and len(value) == HEADER_BYTES + len(page(3))
    raw.close()


def test_reads_and_writes_are_batched_per_primary(store, monkeypatch):
    sent = []
    original = redis.connection.AbstractConnection.send_packed_command

    def counting(self, command, check_health=True):
        sent.append(self.port)
        return original(self, command, check_health)

    store.get(key(0))  # connect and learn the slot map first
    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counting)
    for i in range(100):
        store.put(key(i), page(i))
    sent.clear()
    assert store.get_many([key(i) for i in range(100)]) == [page(i) for i in range(100)]
    # One batch per primary, whatever the number of pages.
    assert len(sent) == len(set(sent)) == 3


def test_flush_one_namespace_on_every_primary(valkey_cluster, store):
    for i in range(60):
        assert store.put(key(i), page(i), NS_A)
        assert store.put(key(i), page(i + 1), NS_B)
    assert store.flush(NS_A) == 60
    assert all(names_on(p, NS_A) == 0 for p in valkey_cluster.primaries())
    assert store.get_many([key(i) for i in range(60)], NS_A) == [None] * 60
    assert store.get_many([key(i) for i in range(60)], NS_B) == [page(i + 1) for i in range(60)]
    assert store.flush() == 60


def test_corrupted_or_misfiled_value_is_a_miss_and_is_deleted(valkey_cluster, store):
    raw = RedisCluster(host="127.0.0.1", port=valkey_cluster.nodes[0].port)
    name0 = b"kvrelay:page:" + bytes(32).hex().encode() + b":" + key(0)
    store.put(key(0), page(0))
    value = bytearray(raw.get(name0))
    value[500] ^= 1
    raw.set(name0, bytes(value))
    assert store.get(key(0)) is None and store.stats.checksum_failures == 1
    assert raw.exists(name0) == 0
    # Another page's record filed under this name, or this page read as tenant A.
    store.put(key(1), page(1))
    raw.set(name0, raw.get(b"kvrelay:page:" + bytes(32).hex().encode() + b":" + key(1)))
    assert store.get_many([key(0), key(1)]) == [None, page(1)]
    assert store.get(key(1), NS_A) is None
    raw.close()


def test_unreachable_cluster_gives_misses_not_errors():
    with open_store(f"valkey-cluster://127.0.0.1:{free_port()}", timeout_s=0.2) as store:
        start = time.monotonic()
        assert store.get(key(0)) is None
        assert not store.put(key(0), page(0))
        assert store.get_many([key(0), key(1)]) == [None, None]
        assert not store.delete(key(0)) and store.flush() == 0
        assert time.monotonic() - start < 2
        assert store.stats.errors >= 1


def test_primary_killed_mid_workload(valkey_cluster, store):
    """A primary dies while pages are written and read; its replica takes over.
    Every read answers the page written under that key or a miss, never another
    page or an error; after the failover every slot serves again."""
    for i in range(200):
        assert store.put(key(i), page(i))
    wrong, raised, reads, stop = [], [], [0], threading.Event()

    def workload():
        try:
            run()
        except Exception as e:  # the store must never raise: the test reports it
            raised.append(e)

    def run():
        i = 200
        while not stop.is_set():
            store.put(key(i), page(i))
            batch = [key(j) for j in range(i - 50, i + 1)]
            for j, got in zip(range(i - 50, i + 1), store.get_many(batch), strict=True):
                if got is not None and got != page(j):
                    wrong.append(j)
            reads[0] += 1
            i += 1

    thread = threading.Thread(target=workload)
    thread.start()
    try:
        time.sleep(0.2)
        victim = valkey_cluster.primaries()[0]
        victim.stop()
        valkey_cluster.wait_ok(timeout=30, replicas=False)
        assert victim.port not in [p.port for p in valkey_cluster.primaries()]
        time.sleep(1.5)  # the workload runs on the promoted replica past the back-off
    finally:
        stop.set()
        thread.join(30)
    try:
        assert not raised and not wrong and reads[0] > 10
        assert store.stats.errors >= 1  # the dead primary's calls failed and became misses
        # Past the back-off the store serves every slot again: writes land, reads hit.
        time.sleep(store.config.backoff_s)
        fresh = [key(10_000 + i) for i in range(100)]
        assert all(store.put(k, page(10_000 + i)) for i, k in enumerate(fresh))
        assert store.get_many(fresh) == [page(10_000 + i) for i in range(100)]
        # Pages written long before the kill had reached the replica.
        early = store.get_many([key(i) for i in range(200)])
        assert sum(p is not None for p in early) >= 190
        assert all(p is None or p == page(i) for i, p in enumerate(early))
    finally:
        victim.start()
        valkey_cluster.wait_ok(timeout=30)


def test_slots_moved_between_primaries(valkey_cluster, store):
    """Slots holding pages move to another primary (`--cluster reshard`): reads
    follow them (MOVED), at worst a miss for a moment, never a wrong page."""
    count = 200
    assert all(store.put(key(i), page(i)) for i in range(count))
    source, target = valkey_cluster.primaries()[:2]
    ids = {n.port: n.client().execute_command("CLUSTER MYID").decode() for n in (source, target)}
    before = names_on(source, bytes(32))
    subprocess.run(
        [cli_binary(valkey_cluster.binary), "--cluster", "reshard", f"127.0.0.1:{source.port}",
         "--cluster-from", ids[source.port], "--cluster-to", ids[target.port],
         "--cluster-slots", "1500", "--cluster-yes"],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    assert names_on(source, bytes(32)) < before  # pages moved with their slots
    got = store.get_many([key(i) for i in range(count)])
    assert all(p is None or p == page(i) for i, p in enumerate(got))
    time.sleep(store.config.backoff_s)
    assert store.get_many([key(i) for i in range(count)]) == [page(i) for i in range(count)]
    assert store.put(key(1000), page(1000)) and store.get(key(1000)) == page(1000)
