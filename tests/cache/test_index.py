import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.cache import CacheIndexError, PageIndex
from kvrelay.layout import ParallelConfig, page_writers
from tests.cache.specs import SPEC
from tests.layout.strategies import kv_specs, parallel_configs


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest()


def sealed_index(n: int, clock: FakeClock | None = None) -> PageIndex:
    index = PageIndex(SPEC.page_bytes, clock or FakeClock())
    for i in range(n):
        index.insert(key(i), i, sealed=True)
        if clock is not None:
            clock.advance(1)
    return index


def test_lookup_returns_longest_sealed_prefix():
    index = sealed_index(5)
    index.insert(key(10), 10)  # unsealed
    keys = [key(0), key(1), key(2), key(10), key(3)]
    assert index.lookup(keys).hits == 3
    assert index.lookup([key(0), key(99), key(1)]).hits == 1
    assert index.lookup([key(99), key(0)]).hits == 0
    assert [e.slot for e in index.lookup(keys[:2]).entries] == [0, 1]


def test_page_seals_only_when_every_rectangle_is_written():
    index = PageIndex(SPEC.page_bytes, FakeClock())
    index.insert(key(0), 0)
    writers = page_writers(SPEC, ParallelConfig(tp=2, pp=2), 0)
    assert len(writers) == 4
    for _, rect in writers[:-1]:
        assert not index.record_rectangle(key(0), SPEC, rect)
        assert index.lookup([key(0)]).hits == 0
    assert index.record_rectangle(key(0), SPEC, writers[-1][1])
    assert index.lookup([key(0)]).hits == 1


@st.composite
def writers_in_any_order(draw):
    spec = draw(kv_specs(max_layers=6, max_dim=4, max_page=4))
    configs = [draw(parallel_configs(spec)) for _ in range(2)]
    page = draw(st.integers(0, 5))
    # Two writer groups with different (tp, pp) each write part of the page,
    # their rectangles interleaved in a random order; the union covers it.
    rects = [rect for config in configs for _, rect in page_writers(spec, config, page)]
    return spec, draw(st.permutations(rects))


@settings(max_examples=200, deadline=None)
@given(writers_in_any_order())
def test_sealing_with_rectangles_in_any_order(case):
    spec, order = case
    index = PageIndex(spec.page_bytes, FakeClock())
    index.insert(key(0), 0)
    covered = bytearray(spec.page_bytes)
    for rect in order:
        sealed = index.record_rectangle(key(0), spec, rect)
        for offset, length in rect.byte_runs(spec):
            covered[offset : offset + length] = b"\x01" * length
        # Sealed exactly when the bytes written so far cover the whole page.
        assert sealed == all(covered)
        assert (index.lookup([key(0)]).hits == 1) == all(covered)
    assert index.get(key(0)).sealed


def test_runs_merge_from_any_side_and_reject_outside():
    index = PageIndex(100, FakeClock())
    index.insert(key(0), 0)
    assert not index.record_runs(key(0), [(50, 10), (10, 10)])
    assert not index.record_runs(key(0), [(20, 30)])  # joins [10,20) and [50,60)
    assert index.get(key(0)).filled == [(10, 60)]
    assert not index.record_runs(key(0), [(60, 40), (5, 10)])  # overlaps are fine
    assert index.get(key(0)).filled == [(5, 100)]
    assert index.record_runs(key(0), [(0, 5)])
    with pytest.raises(CacheIndexError):
        index.record_runs(key(1), [(0, 1)])
    index.insert(key(1), 1)
    for bad in [(-1, 2), (99, 2), (0, 0)]:
        with pytest.raises(CacheIndexError):
            index.record_runs(key(1), [bad])


def test_keys_are_checked_and_inserted_once():
    index = PageIndex(10, FakeClock())
    with pytest.raises(CacheIndexError):
        index.insert(b"short", 0)
    index.insert(key(0), 0)
    with pytest.raises(CacheIndexError):
        index.insert(key(0), 1)


def test_lru_eviction_skips_pinned_and_unsealed_pages():
    clock = FakeClock()
    index = sealed_index(4, clock)
    index.insert(key(9), 9)  # unsealed: never evicted
    # Touch page 0: it becomes the most recently used.
    index.lookup([key(0)])
    clock.advance(1)
    lease = index.pin([key(1)], lease_s=60)
    victims = index.evict(2)
    assert [v.key for v in victims] == [key(2), key(3)]
    assert key(2) not in index and key(3) not in index
    assert [v.key for v in index.evict(10)] == [key(0)]
    assert key(1) in index and key(9) in index
    index.release(lease.lease_id)
    assert [v.key for v in index.evict(10)] == [key(1)]
    assert index.evict(10) == []


def test_evict_where_restricts_the_choice():
    index = sealed_index(3)
    victims = index.evict(10, where=lambda e: e.slot != 0)
    assert sorted(v.key for v in victims) == sorted([key(1), key(2)])
    assert index.get(key(0)).slot == 0


def test_lookup_pins_hits_under_a_lease_until_released():
    index = sealed_index(3)
    result = index.lookup([key(0), key(1), key(7)], lease_s=5)
    assert result.hits == 2 and result.lease is not None
    assert [index.get(key(i)).pins for i in range(3)] == [1, 1, 0]
    assert [v.key for v in index.evict(10)] == [key(2)]
    with pytest.raises(CacheIndexError):
        index.remove(key(0))
    assert index.release(result.lease.lease_id)
    assert not index.release(result.lease.lease_id)
    assert index.get(key(0)).pins == 0
    assert len(index.evict(10)) == 2
    assert index.lookup([key(0)], lease_s=5).lease is None  # no hits, no lease


def test_lease_that_expires_while_pinned_unpins():
    clock = FakeClock()
    index = sealed_index(2, clock)
    lease = index.lookup([key(0), key(1)], lease_s=10).lease
    second = index.pin([key(1)], lease_s=30)
    assert index.get(key(1)).pins == 2
    clock.advance(9.9)
    assert index.evict(10) == []
    clock.advance(0.2)
    # The first lease lapsed: page 0 is free again, page 1 still held by the second.
    assert [v.key for v in index.evict(10)] == [key(0)]
    assert index.get(key(1)).pins == 1
    assert not index.release(lease.lease_id)  # a late release is harmless
    clock.advance(30)
    assert index.num_leases == 0
    assert [v.key for v in index.evict(10)] == [key(1)]
    assert second.lease_id != lease.lease_id


def test_extend_keeps_a_lease_alive():
    clock = FakeClock()
    index = sealed_index(1, clock)
    lease = index.pin([key(0)], lease_s=5)
    clock.advance(4)
    assert index.extend(lease.lease_id, 5)
    clock.advance(4)
    assert index.evict(1) == []
    clock.advance(2)
    assert len(index.evict(1)) == 1
    assert not index.extend(lease.lease_id, 5)


def test_reservation_whose_lease_expires_is_dropped_as_abandoned():
    clock = FakeClock()
    index = PageIndex(SPEC.page_bytes, clock)
    index.insert(key(0), 0)
    index.insert(key(1), 1)
    index.pin([key(0), key(1)], lease_s=5)
    index.record_runs(key(1), [(0, SPEC.page_bytes)])  # sealed while pinned
    assert index.drop_abandoned() == []
    assert index.evict(5) == []  # pinned
    clock.advance(6)
    assert [e.key for e in index.drop_abandoned()] == [key(0)]
    assert [e.key for e in index.evict(5)] == [key(1)]


def test_unpinned_page_counts_its_release_as_last_use():
    clock = FakeClock()
    index = sealed_index(3, clock)
    lease = index.pin([key(0)], lease_s=100)
    clock.advance(1)
    index.release(lease.lease_id)
    assert [v.key for v in index.evict(3)] == [key(1), key(2), key(0)]
