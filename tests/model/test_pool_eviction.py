"""The pools' eviction order: prefix-LRU over released pages, orphans first,
and never fewer pages matched than the LRU order the pools had before."""

import random

import pytest
import torch

from kvrelay.bench.cache_workloads import Shape, sessions_trace
from kvrelay.model import PagedKVPool
from kvrelay.model.latent_pool import LatentKVPool


def make_pool(cls=PagedKVPool, num_pages=4):
    if cls is LatentKVPool:
        return cls(num_pages=num_pages, page_size=4, num_layers=1, latent_dim=8,
                   dtype=torch.float32)  # fmt: skip
    return cls(num_pages=num_pages, page_size=4, num_layers=1, num_heads=1, head_dim=8,
               dtype=torch.float32)  # fmt: skip


class LRUPool(PagedKVPool):
    """The order the pools had before: least recently released first."""

    def _cache(self, page, parent):
        self._evictable[page] = None

    def _evict(self):
        page = next(iter(self._evictable))
        del self._evictable[page]
        del self._page_of_key[self._key_of_page.pop(page)]
        return page


def key(i: int) -> bytes:
    return i.to_bytes(32, "little")


def write(pool, keys, hits: list[int] | None = None) -> list[int]:
    """A request: match its prefix (its length appended to `hits`), compute the
    rest; its pages, in chain order."""
    hit = pool.match_prefix(keys)
    if hits is not None:
        hits.append(len(hit))
    new = pool.allocate(len(keys) - len(hit))
    for page, k in zip(new, keys[len(hit) :], strict=True):
        pool.register(page, k)
    return hit + new


@pytest.mark.parametrize("cls", [PagedKVPool, LatentKVPool])
def test_a_released_chain_goes_from_its_last_page(cls):
    pool = make_pool(cls, num_pages=4)
    chain = write(pool, [key(i) for i in range(3)])
    pool.release(chain)
    pool.release(write(pool, [key(9)]))  # newer, alone
    # LRU would take chain[0] and leave the rest unmatchable.
    assert pool.allocate(1) == [chain[2]]
    assert pool.match_prefix([key(0), key(1), key(2)]) == chain[:2]


def test_a_page_whose_parent_is_gone_goes_first():
    pool = make_pool(num_pages=3)
    a, b = write(pool, [key(0), key(1)])
    pool.release([a, b])
    pool.acquire([b])  # b in use (a mid-chain match), its parent a not
    (c,) = write(pool, [key(5)])
    pool.release([c])
    assert pool.allocate(1) == [c]
    # Only a is evictable, and an allocation must have it.
    assert pool.allocate(1) == [a]
    pool.release([c])  # freed: never keyed again
    (d,) = write(pool, [key(7)])
    pool.release([d])
    pool.release([b])  # b's prefix is gone: dead weight, it goes before d
    assert pool.allocate(1) == [b]
    assert pool.match_prefix([key(7)]) == [d]


def requests(seed: int) -> list[list[bytes]]:
    shape = Shape(sessions=10, turns=5, concurrent=3, system_pages=(3, 6), grow=2,
                  flood=3, flood_pages=(1, 4))  # fmt: skip
    out = [[key(i) for i in r["hash_ids"]] for r in sessions_trace(shape, seed)]
    random.Random(seed).shuffle(out[len(out) // 2 :])  # an irregular second half
    return out


def replay(pool, reqs, in_flight: int) -> list[int]:
    """Each request's matched pages, `in_flight` requests holding pages at once."""
    held, hits = [], []
    for keys in reqs:
        while len(held) >= in_flight or (held and len(keys) > pool.free_pages):
            pool.release(held.pop(0))
        held.append(write(pool, keys, hits))
    return hits


@pytest.mark.parametrize("num_pages", [24, 40, 80])
def test_never_fewer_pages_matched_than_lru(num_pages):
    for seed in range(4):
        reqs = requests(seed)
        lru = replay(make_pool(LRUPool, num_pages), reqs, 1)
        mine = replay(make_pool(PagedKVPool, num_pages), reqs, 1)
        # One request at a time: request by request.
        assert all(m >= o for m, o in zip(mine, lru, strict=True)), (seed, num_pages)
        lru = replay(make_pool(LRUPool, num_pages), reqs, 3)
        mine = replay(make_pool(PagedKVPool, num_pages), reqs, 3)
        assert sum(mine) >= sum(lru), (seed, num_pages)
