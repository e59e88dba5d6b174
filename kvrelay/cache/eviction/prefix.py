"""Prefix-aware eviction: a page is not a victim while a later page of its chain is held.

A prefix hit needs every page before it, so evicting a chain's middle page
makes every page after it dead weight. Pages are *leaves* (no resident
child) or *inner* pages; only leaves are victims. An inner page waits,
parked, until its last resident child leaves, and then queues at the head.
Parked pages are victims only when no leaf can go (every leaf held by a pin
or a writer).

Among leaves, two orders:

- `prefix-lru`: least recently used first (SGLang's radix cache evicts this
  way). Inner pages keep their place in the recency order and are parked
  only when they reach its head, so the order stays the pages' own: one
  parked there was the least recently used page and is unread since, so
  when its last child leaves it is older than every page queued since and
  goes back to the head; one read while parked returns to the tail, as
  a read leaf does; and one whose last child leaves while it is still
  queued keeps its place. (Parking a parent as soon as a child arrives and
  queuing it at the head when the child leaves would evict, right after a
  page, its parent, however recently read: in a sharded tier a lookup
  reads a server's page of a chain and stops at another server's miss
  before that server's next page, so a parent is often newer than its
  child.)
- `prefix-s3fifo`: S3-FIFO's queues: new pages enter a small probation FIFO
  (a tenth of the pages); a page read while there moves to the main FIFO on
  its way out, one never read leaves (a finished one-off request's tail)
  and its key is remembered in a ghost FIFO, so a page that comes back soon
  goes straight to main. Main gives a page read since its last pass
  another pass (up to three). Reads only bump a counter: no reordering.
  It parks a page as soon as a child arrives and queues it at the head
  when its last child leaves.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from typing import ClassVar

from kvrelay.cache.eviction.base import EvictionPolicy

_HELD, _SMALL, _MAIN, _PARKED = 0, 1, 2, 3
_MAX_FREQ = 3


class _Page:
    __slots__ = ("children", "freq", "gone", "key", "main", "parent", "where")

    def __init__(self, key: Hashable, parent: _Page | None, main: bool) -> None:
        self.key = key
        self.parent = parent
        self.children = 0
        self.freq = 0
        self.where = _HELD
        self.main = main  # queues in main (a ghost hit, or read in probation)
        self.gone = False


class _PrefixPolicy(EvictionPolicy):
    """Chain bookkeeping shared by both orders; subclasses own the leaf queues."""

    # Parked when it reaches the head of the queues (the subclass's
    # `_pop_leaf` parks it), not when a child arrives.
    parks_at_head: ClassVar[bool] = False

    def __init__(self) -> None:
        self._pages: dict[Hashable, _Page] = {}
        self._parked: OrderedDict[Hashable, _Page] = OrderedDict()

    # -- the interface -------------------------------------------------------------

    def admit(self, key: Hashable, parent: Hashable | None = None, evictable: bool = False) -> None:
        if key not in self._pages:
            self._admit(key, parent)
        if evictable:
            self.make_evictable(key)

    def _admit(self, key: Hashable, parent: Hashable | None) -> None:
        up = self._pages.get(parent) if parent is not None else None
        page = _Page(key, up, self._from_ghost(key))
        self._pages[key] = page
        if up is not None:
            up.children += 1
            if not self.parks_at_head and up.where in (_SMALL, _MAIN):
                self._dequeue(up)
                up.where = _PARKED
                self._parked[up.key] = up

    def make_evictable(self, key: Hashable) -> None:
        page = self._pages.get(key)
        if page is None or page.where != _HELD:
            return
        if page.children and not self.parks_at_head:
            page.where = _PARKED
            self._parked[key] = page
        else:
            self._enqueue(page, head=False)

    def hold(self, key: Hashable) -> None:
        page = self._pages.get(key)
        if page is not None and page.where != _HELD:
            self._dequeue(page)
            page.where = _HELD

    def forget(self, key: Hashable) -> None:
        page = self._pages.pop(key, None)
        if page is not None:
            self._dequeue(page)
            self._gone(page)

    def victim(self) -> Hashable | None:
        page = self._pop_leaf()
        if page is None:
            if not self._parked:
                return None
            # Nothing else can go: the oldest parked page.
            _, page = self._parked.popitem(last=False)
        del self._pages[page.key]
        self._gone(page)
        return page.key

    def evictable(self) -> Iterator[Hashable]:
        return iter([k for k, p in self._pages.items() if p.where != _HELD])

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._pages

    # -- internals -----------------------------------------------------------------

    def _gone(self, page: _Page) -> None:
        page.gone = True
        page.where = _HELD
        up = page.parent
        if up is None or up.gone:
            return
        up.children -= 1
        if up.children == 0 and up.where == _PARKED:
            del self._parked[up.key]
            self._enqueue(up, head=True)

    def _dequeue(self, page: _Page) -> None:
        if page.where == _PARKED:
            del self._parked[page.key]
        elif page.where != _HELD:
            self._leaf_dequeue(page)

    def _from_ghost(self, key: Hashable) -> bool:
        return False

    def _enqueue(self, page: _Page, head: bool) -> None:
        raise NotImplementedError

    def _leaf_dequeue(self, page: _Page) -> None:
        raise NotImplementedError

    def _pop_leaf(self) -> _Page | None:
        raise NotImplementedError


class PrefixLRUPolicy(_PrefixPolicy):
    name = "prefix-lru"
    parks_at_head = True

    def __init__(self) -> None:
        super().__init__()
        # The evictable pages in recency order, least recent first, but for
        # the inner pages parked on reaching the head.
        self._leaves: OrderedDict[Hashable, _Page] = OrderedDict()

    def touch(self, key: Hashable) -> None:
        self.touch_many((key,))

    def touch_many(self, keys: Sequence[Hashable]) -> None:
        leaves, parked = self._leaves, self._parked
        move = leaves.move_to_end
        for key in keys:
            if key in leaves:
                move(key)
            elif key in parked:  # read while parked: back in the order, at its tail
                page = parked.pop(key)
                page.where = _SMALL
                leaves[key] = page

    def _enqueue(self, page: _Page, head: bool) -> None:
        page.where = _SMALL
        self._leaves[page.key] = page
        if head:
            self._leaves.move_to_end(page.key, last=False)

    def _leaf_dequeue(self, page: _Page) -> None:
        del self._leaves[page.key]

    def _pop_leaf(self) -> _Page | None:
        leaves = self._leaves
        while leaves:
            key, page = leaves.popitem(last=False)
            if not page.children:
                return page
            page.where = _PARKED  # an inner page at the head waits for its children
            self._parked[key] = page
        return None


class PrefixS3FIFOPolicy(_PrefixPolicy):
    name = "prefix-s3fifo"
    small_share = 0.1

    def __init__(self) -> None:
        super().__init__()
        self._small: OrderedDict[Hashable, _Page] = OrderedDict()
        self._main: OrderedDict[Hashable, _Page] = OrderedDict()
        self._ghost: OrderedDict[Hashable, None] = OrderedDict()

    def touch(self, key: Hashable) -> None:
        page = self._pages.get(key)
        if page is not None and page.freq < _MAX_FREQ:
            page.freq += 1

    def _from_ghost(self, key: Hashable) -> bool:
        return self._ghost.pop(key, 0) is None

    def _enqueue(self, page: _Page, head: bool) -> None:
        queue = self._main if page.main else self._small
        page.where = _MAIN if page.main else _SMALL
        queue[page.key] = page
        if head:
            queue.move_to_end(page.key, last=False)

    def _leaf_dequeue(self, page: _Page) -> None:
        del (self._main if page.where == _MAIN else self._small)[page.key]

    def _pop_leaf(self) -> _Page | None:
        small, main = self._small, self._main
        while small or main:
            if small and (not main or len(small) >= self.small_share * len(self._pages)):
                _, page = small.popitem(last=False)
                if page.freq:
                    page.freq, page.main, page.where = 0, True, _MAIN
                    main[page.key] = page
                    continue
                self._ghost[page.key] = None
                while len(self._ghost) > len(self._pages):
                    self._ghost.popitem(last=False)
                return page
            _, page = main.popitem(last=False)
            if page.freq:
                page.freq -= 1
                main[page.key] = page
                continue
            return page
        return None
