"""Partial-foresight bounds: what an online policy could reach if it knew
which pages will be read again, or how often, but not when.

Belady knows when each page is read next. An online policy knows the past;
the best it can learn from recency and frequency is, at most, a page's
future worth without its timing. These replays give that the benefit of
the doubt, as a yardstick between LRU and Belady:

- `oracle-dead`: LRU that knows whether a page will ever be read again.
  A page that will not is never admitted (a perfect admission filter, what
  S3-FIFO's probation queue and TinyLFU approximate) and, once its last
  read is past, is evicted first.
- `oracle-count`: evicts the page with the fewest reads left (a perfect
  frequency estimate, what LFU-style policies approximate); pages with none
  left are not admitted.

Ties go to the least recently used page, then the deeper one, so a
resident page's prefix stays within one cache (a parent has at least its
child's reads left and was read at the same time). Hits follow the prefix
rule and servers are replayed as Belady's are (`prefix_replay`).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Hashable, Sequence

from kvrelay.bench.belady import Route, prefix_replay

ORACLES = ("oracle-dead", "oracle-count")


class _OracleCache:
    """One server: resident key -> rank, a min-heap of ranks with stale entries
    skipped when they surface; the lowest rank is the victim."""

    def __init__(self, capacity: int, by_count: bool) -> None:
        self.capacity, self.by_count = capacity, by_count
        self.resident: dict[Hashable, tuple[int, int, int]] = {}
        self._heap: list[tuple[tuple[int, int, int], Hashable]] = []

    def _rank(self, left: int, clock: int, depth: int) -> tuple[int, int, int]:
        worth = left if self.by_count else min(left, 1)
        return (worth, clock, -depth)

    def access(self, key: Hashable, left: int, clock: int, depth: int) -> None:
        """The key was read (a hit, or a miss the tier would write); `left`
        reads of it remain after this one."""
        rank = self._rank(left, clock, depth)
        if key not in self.resident:
            if left == 0 or self.capacity <= 0:
                return  # never read again: not admitted
            if len(self.resident) >= self.capacity:
                victim = self._lowest()
                if victim[1] >= rank:
                    return  # the newcomer is worth the least
                heapq.heappop(self._heap)
                del self.resident[victim[0]]
        self.resident[key] = rank
        heapq.heappush(self._heap, (rank, key))
        if len(self._heap) > 4 * max(len(self.resident), 64):
            self._heap = [(r, k) for k, r in self.resident.items()]
            heapq.heapify(self._heap)

    def _lowest(self) -> tuple[Hashable, tuple[int, int, int]]:
        while True:
            rank, key = self._heap[0]
            if self.resident.get(key) == rank:
                return key, rank
            heapq.heappop(self._heap)


def oracle_hits(
    key_lists: Sequence[Sequence[Hashable]],
    capacities: Sequence[int],
    route: Route,
    name: str,
) -> list[int]:
    """Per request, its prefix hits under the named oracle (`ORACLES`);
    `capacities` per server, `route(request number, key)` picks the server."""
    if name not in ORACLES:
        raise ValueError(f"oracle must be one of {ORACLES}, got {name!r}")
    caches = [_OracleCache(c, by_count=name == "oracle-count") for c in capacities]
    left = Counter(key for keys in key_lists for key in keys)

    def access(cache: _OracleCache, number: int, depth: int, key: Hashable) -> None:
        left[key] -= 1
        cache.access(key, left[key], number, depth)

    return prefix_replay(key_lists, caches, route, access)
