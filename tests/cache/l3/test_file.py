import hashlib
import os

from kvrelay.cache.l3.file import FileStore, FileStoreConfig
from kvrelay.cache.l3.record import HEADER_BYTES

PAGE = 1000
RECORD = HEADER_BYTES + PAGE


def key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest()


def page(i: int) -> bytes:
    return bytes([i % 256]) * PAGE


def make(tmp_path, pages: int = 4, **kw) -> FileStore:
    return FileStore(FileStoreConfig(tmp_path / "l3", capacity_bytes=pages * RECORD, **kw))


def page_files(store: FileStore) -> list:
    return sorted(store.root.glob("*/??/*.page"))


def test_lru_eviction_at_capacity(tmp_path):
    store = make(tmp_path)
    for i in range(4):
        assert store.put(key(i), page(i))
    assert store.used_bytes == 4 * RECORD
    assert store.get(key(0)) == page(0)  # 0 becomes most recently used
    assert store.put(key(4), page(4))
    assert store.put(key(5), page(5))
    assert [store.get(key(i)) is not None for i in range(6)] == [1, 0, 0, 1, 1, 1]
    assert store.stats.evictions == 2
    assert len(page_files(store)) == 4 and store.used_bytes == 4 * RECORD


def test_page_larger_than_capacity_is_not_stored(tmp_path):
    store = make(tmp_path, pages=1)
    assert not store.put(key(0), page(0) + b"x")
    assert store.put(key(0), page(0))
    assert page_files(store) and store.get(key(0)) == page(0)


def test_corrupted_file_is_a_miss_and_is_deleted(tmp_path):
    store = make(tmp_path)
    store.put(key(0), page(0))
    store.put(key(1), page(1))
    path = store._path(key(0))
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES + 500] ^= 0xFF
    path.write_bytes(bytes(data))
    assert store.get(key(0)) is None
    assert not path.exists() and key(0) not in store
    assert store.stats.checksum_failures == 1
    assert store.used_bytes == RECORD
    # A truncated file, as a non-atomic writer would leave, is caught the same way.
    path1 = store._path(key(1))
    path1.write_bytes(path1.read_bytes()[:-10])
    assert store.get(key(1)) is None and not path1.exists()
    assert store.stats.checksum_failures == 2


def test_restart_keeps_pages_and_lru_order(tmp_path):
    store = make(tmp_path)
    for i in range(4):
        store.put(key(i), page(i))
    # mtimes record the order; make it unambiguous on coarse clocks.
    for i in range(4):
        os.utime(store._path(key(i)), ns=(10**18 + i * 10**9,) * 2)
    os.utime(store._path(key(0)), ns=(10**18 + 9 * 10**9,) * 2)  # 0 used last
    reopened = make(tmp_path)
    assert len(reopened) == 4 and reopened.used_bytes == 4 * RECORD
    assert reopened.get(key(2)) == page(2)
    reopened.put(key(4), page(4))
    # 1 was least recently used (2 was just read, 0 was touched last before).
    assert key(1) not in reopened and not reopened._path(key(1)).exists()
    assert all(reopened.get(key(i)) == page(i) for i in (0, 2, 3, 4))


def test_restart_with_smaller_capacity_evicts(tmp_path):
    store = make(tmp_path)
    for i in range(4):
        store.put(key(i), page(i))
    smaller = make(tmp_path, pages=2)
    assert len(smaller) == 2 and len(page_files(smaller)) == 2


def test_interrupted_write_leaves_nothing_visible(tmp_path):
    store = make(tmp_path)
    store.put(key(0), page(0))
    # A writer killed before its rename leaves only a temporary file.
    tmp = store.root / "tmp" / f"{key(1).hex()}.123.456"
    tmp.write_bytes(b"partial")
    assert store.get(key(1)) is None
    reopened = make(tmp_path)
    assert not tmp.exists()
    assert len(reopened) == 1 and reopened.get(key(0)) == page(0)


def test_a_file_removed_behind_the_store_is_a_miss(tmp_path):
    store = make(tmp_path)
    store.put(key(0), page(0))
    store._path(key(0)).unlink()
    assert store.get(key(0)) is None and key(0) not in store and store.used_bytes == 0


def test_fsync_option_writes_the_same(tmp_path):
    store = make(tmp_path, fsync=True)
    assert store.put(key(0), page(0)) and store.get(key(0)) == page(0)


def test_flush_one_namespace_keeps_others_and_survives_restart(tmp_path):
    a, b = key(100), key(200)
    store = make(tmp_path, pages=8)
    for i in range(3):
        store.put(key(i), page(i), a)
    store.put(key(0), page(9), b)  # the same key in another namespace is another page
    assert store.get(key(0), a) == page(0) and store.get(key(0), b) == page(9)
    assert store.get(key(0)) is None
    # A restart finds every namespace's files; another process's stray file too.
    reopened = make(tmp_path, pages=8)
    assert len(reopened) == 4 and reopened.get(key(2), a) == page(2)
    stray = reopened._path(key(7), a)
    stray.parent.mkdir(parents=True, exist_ok=True)
    stray.write_bytes(b"left by another process")
    assert reopened.flush(a) == 4
    assert reopened.get(key(1), a) is None and not stray.exists()
    assert len(reopened) == 1 and reopened.used_bytes == RECORD
    assert reopened.get(key(0), b) == page(9)
    assert reopened.flush() == 1 and page_files(reopened) == []


def test_a_file_moved_to_another_namespace_is_a_miss(tmp_path):
    a, b = key(100), key(200)
    store = make(tmp_path)
    store.put(key(0), page(0), a)
    target = store._path(key(0), b)
    target.parent.mkdir(parents=True)
    store._path(key(0), a).rename(target)
    reopened = make(tmp_path)
    assert reopened.get(key(0), b) is None and reopened.stats.checksum_failures == 1


def test_byte_cap_evicts_through_the_chosen_policy(tmp_path):
    store = make(tmp_path, eviction="prefix-lirs")
    for i in range(4):
        assert store.put(key(i), page(i))
    for _ in range(2):
        assert store.get(key(0)) == page(0)  # read again: LIR under prefix-lirs
    # As many new pages as the cap holds: LRU would evict key 0 last of all,
    # LIRS keeps it (not yet so long unread that it counts as finished).
    for i in range(4, 8):
        assert store.put(key(i), page(i))
    assert store.get(key(0)) == page(0)
    assert len(page_files(store)) == 4 and store.used_bytes == 4 * RECORD
    assert store.stats.evictions == 4


def test_unknown_eviction_policy_is_refused(tmp_path):
    import pytest

    with pytest.raises(ValueError, match="eviction policy"):
        make(tmp_path, eviction="fifo")
