"""What every L3 store promises, run against real files and a real server."""

import hashlib

import pytest

from kvrelay.cache.l3 import L3Store, open_store


def key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest()


def page(i: int, size: int = 4096) -> bytes:
    # Every byte value, including the ones a text protocol would mangle.
    return (bytes(range(256)) * (size // 256 + 1))[i % 256 : i % 256 + size]


@pytest.fixture(params=["file", "valkey", "valkey-cluster"])
def store(request, tmp_path) -> L3Store:
    if request.param == "file":
        s = open_store(f"file:{tmp_path / 'l3'}", capacity_bytes=1 << 20)
    elif request.param == "valkey":
        server = request.getfixturevalue("valkey_server")
        s = open_store(f"valkey://127.0.0.1:{server.port}")
    else:
        # One cluster for the module: each test starts from an empty store.
        s = open_store(request.getfixturevalue("valkey_cluster").url)
        s.flush()
    with s:
        yield s


def test_put_get_delete(store):
    assert store.get(key(0)) is None
    assert store.put(key(0), page(0))
    assert store.put(key(1), memoryview(page(1)))
    assert store.get(key(0)) == page(0)
    assert store.get_many([key(1), key(2), key(0)]) == [page(1), None, page(0)]
    assert store.delete(key(0))
    assert not store.delete(key(0))
    assert store.get(key(0)) is None
    assert store.stats.puts == 2 and store.stats.hits == 3
    assert store.stats.bytes_in == 2 * 4096 and store.stats.bytes_out == 3 * 4096
    assert store.stats.errors == 0


def test_put_replaces(store):
    assert store.put(key(0), page(0))
    assert store.put(key(0), page(7, 100))
    assert store.get(key(0)) == page(7, 100)


def test_namespaces_are_apart_and_flush_one(store):
    a, b = key(100), key(200)
    assert store.put(key(0), page(0), a)
    assert store.put(key(1), page(1), a)
    assert store.put(key(0), page(5), b)
    assert store.get(key(0), b) == page(5) and store.get(key(0)) is None
    assert store.get_many([key(0), key(1)], a) == [page(0), page(1)]
    assert store.flush(a) == 2
    assert store.get_many([key(0), key(1)], a) == [None, None]
    assert store.get(key(0), b) == page(5)
    assert not store.delete(key(0), a) and store.delete(key(0), b)


def test_bad_keys_raise(store):
    with pytest.raises(ValueError):
        store.put(b"short", b"x")
    with pytest.raises(ValueError):
        store.get(key(0) + b"x")


def test_open_store_rejects_unknown_urls(tmp_path):
    bad_clusters = ["valkey-cluster://", "valkey-cluster://host", "redis-cluster://h:1,h:port"]
    for url in ["s3://bucket", "valkey://host", "file:", *bad_clusters]:
        with pytest.raises(ValueError):
            open_store(url, capacity_bytes=1)
    with pytest.raises(ValueError):
        open_store(f"file:{tmp_path}")
