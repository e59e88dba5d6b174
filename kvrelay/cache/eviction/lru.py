"""`lru`: least recently used first, blind to chains and to how often a page was read."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence

from kvrelay.cache.eviction.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self) -> None:
        self._resident: set[Hashable] = set()
        # Evictable pages, least recently used first.
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def admit(self, key: Hashable, parent: Hashable | None = None, evictable: bool = False) -> None:
        self._resident.add(key)
        if evictable:
            order = self._order
            order[key] = None
            order.move_to_end(key)

    def make_evictable(self, key: Hashable) -> None:
        if key in self._resident:
            self._order[key] = None
            self._order.move_to_end(key)

    def hold(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def touch(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def touch_many(self, keys: Sequence[Hashable]) -> None:
        order = self._order
        move = order.move_to_end
        for key in keys:
            if key in order:
                move(key)

    def forget(self, key: Hashable) -> None:
        self._resident.discard(key)
        self._order.pop(key, None)

    def victim(self) -> Hashable | None:
        if not self._order:
            return None
        key, _ = self._order.popitem(last=False)
        self._resident.discard(key)
        return key

    def evictable(self) -> Iterator[Hashable]:
        return iter(list(self._order))

    def __len__(self) -> int:
        return len(self._resident)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._resident
