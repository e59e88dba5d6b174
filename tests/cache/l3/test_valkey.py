"""The valkey store against a real Valkey/Redis server started per test."""

import hashlib
import time

import redis

from kvrelay.cache.l3.valkey import ValkeyStore, ValkeyStoreConfig


def key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest()


PAGE = bytes(range(256)) * 64


def make(server, **kw) -> ValkeyStore:
    return ValkeyStore(ValkeyStoreConfig(port=server.port, **kw))


def raw_client(server) -> redis.Redis:
    return redis.Redis(port=server.port, socket_timeout=5)


def test_pages_are_shared_between_stores(valkey_server):
    with make(valkey_server) as writer, make(valkey_server) as reader:
        assert writer.put(key(0), PAGE)
        assert reader.get(key(0)) == PAGE
    # Stored as one binary value under kvrelay's prefix, with its checked header.
    value = raw_client(valkey_server).get(b"kvrelay:page:" + key(0))
    assert value.endswith(PAGE) and len(value) == 64 + len(PAGE)


def test_corrupted_value_is_a_miss_and_is_deleted(valkey_server):
    client = raw_client(valkey_server)
    with make(valkey_server) as store:
        store.put(key(0), PAGE)
        name = b"kvrelay:page:" + key(0)
        value = bytearray(client.get(name))
        value[1000] ^= 1
        client.set(name, bytes(value))
        assert store.get(key(0)) is None
        assert store.stats.checksum_failures == 1
        assert client.exists(name) == 0
        # A value written under another page's name is caught too.
        store.put(key(1), PAGE)
        client.set(name, client.get(b"kvrelay:page:" + key(1)))
        assert store.get_many([key(0), key(1)]) == [None, PAGE]
        assert store.stats.checksum_failures == 2


def test_ttl_expires_pages(valkey_server):
    with make(valkey_server, ttl_s=100) as store:
        store.put(key(0), PAGE)
        assert 0 < raw_client(valkey_server).ttl(b"kvrelay:page:" + key(0)) <= 100


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


def test_stopped_server_times_out_to_a_miss_and_recovers(valkey_server):
    with make(valkey_server, timeout_s=0.2, backoff_s=0.3) as store:
        store.put(key(0), PAGE)
        valkey_server.pause()
        try:
            start = time.monotonic()
            assert store.get(key(0)) is None
            elapsed = time.monotonic() - start
            assert 0.15 < elapsed < 1.5, elapsed
            # Within the back-off the store is not asked at all.
            start = time.monotonic()
            assert store.get(key(0)) is None
            assert time.monotonic() - start < 0.1
        finally:
            valkey_server.resume()
        time.sleep(0.35)
        assert store.get(key(0)) == PAGE
