"""The valkey store against a real Valkey/Redis server started per test."""

import hashlib
import time

import redis

from kvrelay.cache.l3 import valkey as valkey_module
from kvrelay.cache.l3.record import HEADER_BYTES, NO_NAMESPACE
from kvrelay.cache.l3.valkey import ValkeyStore, ValkeyStoreConfig


def key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest()


PAGE = bytes(range(256)) * 64


def make(server, **kw) -> ValkeyStore:
    return ValkeyStore(ValkeyStoreConfig(port=server.port, **kw))


def name(k: bytes, namespace: bytes = NO_NAMESPACE) -> bytes:
    return b"kvrelay:page:" + namespace.hex().encode() + b":" + k


def raw_client(server) -> redis.Redis:
    return redis.Redis(port=server.port, socket_timeout=5)


def test_pages_are_shared_between_stores(valkey_server):
    with make(valkey_server) as writer, make(valkey_server) as reader:
        assert writer.put(key(0), PAGE)
        assert reader.get(key(0)) == PAGE
    # Stored as one binary value under kvrelay's prefix, with its checked header.
    value = raw_client(valkey_server).get(name(key(0)))
    assert value.endswith(PAGE) and len(value) == HEADER_BYTES + len(PAGE)


def test_corrupted_value_is_a_miss_and_is_deleted(valkey_server):
    client = raw_client(valkey_server)
    with make(valkey_server) as store:
        store.put(key(0), PAGE)
        name0 = name(key(0))
        value = bytearray(client.get(name0))
        value[1000] ^= 1
        client.set(name0, bytes(value))
        assert store.get(key(0)) is None
        assert store.stats.checksum_failures == 1
        assert client.exists(name0) == 0
        # A value written under another page's name is caught too.
        store.put(key(1), PAGE)
        client.set(name0, client.get(name(key(1))))
        assert store.get_many([key(0), key(1)]) == [None, PAGE]
        assert store.stats.checksum_failures == 2


def test_ttl_expires_pages(valkey_server):
    with make(valkey_server, ttl_s=100) as store:
        store.put(key(0), PAGE)
        assert 0 < raw_client(valkey_server).ttl(name(key(0))) <= 100


def test_killed_server_gives_misses_not_errors(valkey_server):
    with make(valkey_server, timeout_s=0.2, backoff_s=0.5) as store:
        store.put(key(0), PAGE)
        valkey_server.stop()
        start = time.monotonic()
        assert store.get(key(0)) is None
        assert not store.put(key(1), PAGE)
        assert store.get_many([key(0), key(1)]) == [None, None]
        assert not store.delete(key(0))
        assert time.monotonic() - start < 2
        assert store.stats.errors >= 1


def test_stopped_server_times_out_to_a_miss_and_recovers(valkey_server, fake_clock, monkeypatch):
    # The back-off runs on a fake clock: no sleeping past it, no wall-clock window.
    fake_clock.install(monkeypatch, valkey_module)
    with make(valkey_server, timeout_s=0.2, backoff_s=0.3) as store:
        store.put(key(0), PAGE)
        valkey_server.pause()
        try:
            assert store.get(key(0)) is None  # the socket timeout: a miss, not a hang
            assert store.stats.errors == 1
            # Within the back-off the store is not asked at all (asking would
            # time out again and count a second error).
            fake_clock.advance(0.29)
            assert store.get(key(0)) is None and store.stats.errors == 1
        finally:
            valkey_server.resume()
        fake_clock.advance(0.02)  # past the back-off: asked again, and it answers
        assert store.get(key(0)) == PAGE
        assert store.stats.errors == 1


def test_flush_scans_one_namespace_and_leaves_the_rest(valkey_server):
    client = raw_client(valkey_server)
    client.set(b"someone-else:" + key(0), b"x")  # not kvrelay's: never touched
    tenant_a, tenant_b = key(100), key(200)
    with make(valkey_server) as store:
        for i in range(2500):  # more than one SCAN batch and one UNLINK batch
            assert store.put(key(i), PAGE[:64], tenant_a)
        for i in range(3):
            assert store.put(key(i), PAGE, tenant_b)
        store.put(key(9), PAGE)  # no namespace
        assert store.flush(tenant_a) == 2500
        assert store.get_many([key(0), key(1)], tenant_a) == [None, None]
        assert store.get(key(0), tenant_b) == PAGE and store.get(key(9)) == PAGE
        assert store.flush(tenant_a) == 0
        assert store.flush() == 4
        assert store.get(key(9)) is None
    assert client.get(b"someone-else:" + key(0)) == b"x"


def test_a_prefix_with_glob_characters_matches_literally(valkey_server):
    client = raw_client(valkey_server)
    with (
        make(valkey_server, prefix=b"kv[1]*:") as odd,
        make(valkey_server, prefix=b"kv1x:") as plain,
    ):
        odd.put(key(0), PAGE)
        plain.put(key(0), PAGE)
        assert odd.flush() == 1
        assert plain.get(key(0)) == PAGE and client.dbsize() == 1
