"""`prefix-lru`, the reference: LRU among the pages no later page of their chain depends on.

A prefix hit needs every page before it, so a page whose chain parent is
gone is never hit until the parent returns. Pages are *leaves* (no resident
child) or *inner* pages, and the victim is always the least recently used
leaf; an inner page is never a victim. When every leaf is held (pinned by a
reader, or being written), nothing goes: the owner's write finds no room,
and the pages it would have displaced, ancestors of held pages, stay,
unless the owner asks for one (`victim_inner`: a tier with an L3 demotes it
there and loses nothing; the oldest parked page).

Why that is never worse than LRU, one server at a time: a lookup reads a
chain's resident prefix parent first, so a page is never read later than
its child's read in the same lookup, and a request's pages last read by
the same lookup form one tail of its chain. LRU, taking the least recently
read page, takes that tail's shallowest page first and leaves the deeper
ones dead; this order takes its deepest first, which is the only place the
two differ, so every page LRU holds with its whole prefix this order holds
too. Refusing to evict an ancestor for a page being written gives up that
page only, which could never be hit without the ancestor.

The order: inner pages keep their place in the recency order and are parked
only when they reach its head, so the order stays the pages' own (in a
sharded tier a lookup can read a server's page of a chain and stop at
another server's miss before that server's next page, so a parent can be
newer than its child). A parked page was the least recently used page and
is unread since: when its last child leaves it goes back to the head; read
while parked, it returns to the tail, as a read leaf does.

One guess at dead pages rides on the order: a page admitted right after a
lookup that hit nothing here (a one-off prompt's, a scan's) is *cold* until
read, and a cold leaf goes before the order's victim, a cold chain from its
end. The guess keeps its own record: right when a cold page leaves unread
by the order, wrong when one is read or a page it evicted comes back (its
keys are remembered, as many as pages are resident). It acts only while it
has been right `guess_weight` (16) times per error, so it stays silent
wherever one-off pages are not the rule (a sharded server's share of a
session also starts with a lookup that hit nothing there), and stops as
soon as its errors catch up.

The index runs the compiled twin (`compiled.py`); this is the reference it
is tested against, call for call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence

from kvrelay.cache.eviction.base import EvictionPolicy

_HELD, _ORDER, _PARKED = 0, 1, 2


class _Page:
    __slots__ = ("children", "cold", "gone", "key", "parent", "where")

    def __init__(self, key: Hashable, parent: _Page | None, cold: bool) -> None:
        self.key = key
        self.parent = parent
        self.children = 0
        self.where = _HELD
        self.cold = cold  # guessed dead: admitted after a lookup with no hit, unread since
        # Children hold their parent object: once it has left they must not
        # count against a later page of the same key.
        self.gone = False


class PrefixLRUReference(EvictionPolicy):
    name = "prefix-lru"
    # The dead-page guess acts while it has been right this many times per error.
    guess_weight = 16

    def __init__(self) -> None:
        self._pages: dict[Hashable, _Page] = {}
        # Evictable pages, least recently used first, but for inner pages
        # parked on reaching the head.
        self._order: OrderedDict[Hashable, _Page] = OrderedDict()
        self._parked: OrderedDict[Hashable, _Page] = OrderedDict()
        # The guess (module doc): cold leaves in the order; pages it evicted.
        self._cold_leaves: OrderedDict[Hashable, _Page] = OrderedDict()
        self._early: OrderedDict[Hashable, None] = OrderedDict()
        self._cold_next = False  # the last lookup hit nothing here
        self._right = self._wrong = 0

    def admit(self, key: Hashable, parent: Hashable | None = None, evictable: bool = False) -> None:
        if key not in self._pages:
            if self._early.pop(key, 0) is None:  # evicted by the guess, and wanted
                self._wrong += 1
            up = self._pages.get(parent) if parent is not None else None
            self._pages[key] = _Page(key, up, self._cold_next)
            if up is not None:
                up.children += 1
                self._cold_leaves.pop(up.key, None)
        if evictable:
            self.make_evictable(key)

    def make_evictable(self, key: Hashable) -> None:
        page = self._pages.get(key)
        if page is not None and page.where == _HELD:
            page.where = _ORDER
            self._order[key] = page
            if page.cold and not page.children:
                self._cold_leaves[key] = page

    def hold(self, key: Hashable) -> None:
        page = self._pages.get(key)
        if page is not None:
            self._dequeue(page)

    def touch(self, key: Hashable) -> None:
        self.touch_many((key,))

    def touch_many(self, keys: Sequence[Hashable]) -> None:
        self._cold_next = not keys
        order, parked, pages = self._order, self._parked, self._pages
        move = order.move_to_end
        for key in keys:
            page = pages.get(key)
            if page is None:
                continue
            if page.cold:  # the guess was wrong
                page.cold = False
                self._wrong += 1
                self._cold_leaves.pop(key, None)
            if page.where == _ORDER:
                move(key)
            elif page.where == _PARKED:  # read while parked: back in the order, at its tail
                del parked[key]
                page.where = _ORDER
                order[key] = page

    def forget(self, key: Hashable) -> None:
        page = self._pages.pop(key, None)
        if page is not None:
            self._dequeue(page)
            self._gone(page)

    def victim(self) -> Hashable | None:
        if self._cold_leaves and self.guess_weight * self._wrong < self._right:
            key, page = self._cold_leaves.popitem(last=False)
            del self._order[key]
            self._early[key] = None
            while len(self._early) > max(64, len(self._pages)):
                self._early.popitem(last=False)
            return self._leave(page)
        order = self._order
        while order:
            key, page = order.popitem(last=False)
            if not page.children:
                if page.cold:  # left unread: the guess would have been right
                    self._right += 1
                    del self._cold_leaves[key]
                return self._leave(page)
            page.where = _PARKED  # an inner page at the head waits for its children
            self._parked[key] = page
        return None  # every leaf is held: no ancestor of theirs goes

    def victim_inner(self) -> Hashable | None:
        if not self._parked:
            return None
        _, page = self._parked.popitem(last=False)  # the least recently used
        self._right += page.cold
        return self._leave(page)

    def evictable(self) -> Iterator[Hashable]:
        return iter([k for k, p in self._pages.items() if p.where != _HELD])

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._pages

    def _leave(self, page: _Page) -> Hashable:
        page.where = _HELD
        del self._pages[page.key]
        self._gone(page)
        return page.key

    def _dequeue(self, page: _Page) -> None:
        if page.where == _ORDER:
            del self._order[page.key]
            self._cold_leaves.pop(page.key, None)
        elif page.where == _PARKED:
            del self._parked[page.key]
        page.where = _HELD

    def _gone(self, page: _Page) -> None:
        page.gone = True
        up = page.parent
        if up is None or up.gone:
            return
        up.children -= 1
        if up.children:
            return
        if up.where == _PARKED:
            # Parked at the head and unread since: the least recently used.
            del self._parked[up.key]
            up.where = _ORDER
            self._order[up.key] = up
            self._order.move_to_end(up.key, last=False)
        if up.cold and up.where == _ORDER:  # a cold chain goes from its end
            self._cold_leaves[up.key] = up
            self._cold_leaves.move_to_end(up.key, last=False)


def reference_state(policy: PrefixLRUReference) -> dict:
    """The reference's state as the compiled policy's `debug_state` gives it."""
    pages = policy._pages
    return {
        "order": list(policy._order),
        "parked": list(policy._parked),
        "held": [k for k, p in pages.items() if p.where == _HELD],
        "children": {k: p.children for k, p in pages.items()},
        "parent": {
            k: (p.parent.key if p.parent is not None and not p.parent.gone else None)
            for k, p in pages.items()
        },
        "cold": [k for k, p in pages.items() if p.cold],
        "cold_leaves": list(policy._cold_leaves),
        "early": list(policy._early),
        "counts": (policy._right, policy._wrong, policy._cold_next),
    }
