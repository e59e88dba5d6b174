"""Belady's offline bound for a prefix cache: evict the page read farthest in the future.

A replay, not a policy: it needs the whole trace. Hits follow the prefix
rule of every lookup: a request's page hits only if every earlier page of
the request hit. A page's parent is read by every request that reads the
page, so the parent's next read is never later than the child's; ties
(the same next request) evict the deeper page, so a resident page's prefix
stays resident within one cache. A page whose next read is farther than
every resident page's is not admitted (bypass): the bound assumes the best
choice, an online tier writes what it missed.

Sharded replays (`route`) run one cache per server, each with its
`capacity`, and count a request's hits up to the first page its server does
not hold, as the tier's clients do.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Sequence

Route = Callable[[int, Hashable], int]


def next_uses(key_lists: Sequence[Sequence[Hashable]]) -> list[list[int]]:
    """Per request and position, the index of the next request that reads that key
    (len(key_lists) when none does)."""
    never = len(key_lists)
    seen: dict[Hashable, int] = {}
    out: list[list[int]] = [[] for _ in key_lists]
    for number in range(len(key_lists) - 1, -1, -1):
        keys = key_lists[number]
        out[number] = [seen.get(key, never) for key in keys]
        for key in keys:
            seen[key] = number
    return out


class _BeladyCache:
    """One server's cache: resident key -> (next read, depth), and a max-heap of them
    whose stale entries are skipped when they surface."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.resident: dict[Hashable, tuple[int, int]] = {}
        self._heap: list[tuple[int, int, int, Hashable]] = []
        self._pushes = 0

    def _push(self, key: Hashable, rank: tuple[int, int]) -> None:
        self.resident[key] = rank
        self._pushes += 1
        heapq.heappush(self._heap, (-rank[0], -rank[1], self._pushes, key))

    def _farthest(self) -> tuple[Hashable, tuple[int, int]]:
        while True:
            neg_next, neg_depth, _, key = self._heap[0]
            rank = (-neg_next, -neg_depth)
            if self.resident.get(key) == rank:
                return key, rank
            heapq.heappop(self._heap)

    def access(self, key: Hashable, next_read: int, depth: int) -> None:
        """The key was read (hit or written after a miss); its next read is `next_read`."""
        rank = (next_read, depth)
        if key in self.resident:
            self._push(key, rank)
            return
        if self.capacity <= 0:
            return
        if len(self.resident) >= self.capacity:
            victim, victim_rank = self._farthest()
            if victim_rank <= rank:
                return  # bypass: the newcomer is the one read last
            heapq.heappop(self._heap)
            del self.resident[victim]
        self._push(key, rank)
        if len(self._heap) > 4 * max(len(self.resident), 64):
            self._compact()

    def _compact(self) -> None:
        self._heap = [(-n, -d, i, k) for i, (k, (n, d)) in enumerate(self.resident.items())]
        heapq.heapify(self._heap)
        self._pushes = len(self._heap)


def belady_hits(
    key_lists: Sequence[Sequence[Hashable]],
    capacities: Sequence[int],
    route: Route | None = None,
) -> list[int]:
    """Per request, its prefix hits under Belady's rule; `capacities` per server,
    `route(request number, key)` picks the server (default: the one server)."""
    if route is None:
        if len(capacities) != 1:
            raise ValueError("several capacities need a route")

        def route(_number: int, _key: Hashable) -> int:
            return 0

    nexts = next_uses(key_lists)

    def access(cache: _BeladyCache, number: int, depth: int, key: Hashable) -> None:
        cache.access(key, nexts[number][depth], depth)

    return prefix_replay(key_lists, [_BeladyCache(c) for c in capacities], route, access)


def prefix_replay(key_lists, caches, route: Route, access) -> list[int]:
    """Per request, its prefix hits over sharded caches (each with a `resident`
    mapping): hits count up to the first page its server does not hold, then
    `access(cache, request number, depth, key)` for every page, in order."""
    hits_per_request = []
    for number, keys in enumerate(key_lists):
        servers = [caches[route(number, key)] for key in keys]
        hits = 0
        while hits < len(keys) and keys[hits] in servers[hits].resident:
            hits += 1
        hits_per_request.append(hits)
        for depth, (key, cache) in enumerate(zip(keys, servers, strict=True)):
            access(cache, number, depth, key)
    return hits_per_request
