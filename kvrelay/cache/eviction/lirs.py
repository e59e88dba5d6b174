"""`prefix-lirs`, the default: LIRS ordering, kept prefix-aware.

LIRS (Jiang and Zhang, 2002) ranks a page by its *inter-reference recency*:
how many other pages were read between its last two reads. Pages with a
short one are LIR (low IRR) and hold at most 70 % of the cache; the rest
are HIR, in a FIFO `Q` whose head is the next victim. A recency stack `S`
holds the LIR pages and the HIR pages read since the oldest LIR page,
resident or not (a non-resident entry, a ghost, only remembers the key): a
HIR page read again while still in `S` was re-read sooner than the oldest
LIR page, so it turns LIR, and the oldest LIR page turns HIR when LIR pages
are over their share. Unlike the paper's LIRS, a new page is HIR even in an
empty cache: a page turns LIR only by a re-read, so pages never read again
leave in the order they came (as LRU would), and `S` keeps every page while
no page is LIR. This is how frequency enters: a page
read once goes through `Q` and out (a finished one-off request's tail); a
page read again soon (a shared system prompt, a session's context resent
every turn) stays LIR; and a set of pages re-read in a loop larger than the
cache keeps a fixed part of the loop instead of losing all of it, as LRU
does when sessions take turns.

Prefix-awareness: a HIR page with a resident child (a later page of its
chain) is parked out of `Q` until its last child leaves, then queues at the
head: the child just went as the coldest page. Parked pages are victims
only when nothing else can go. Held pages (pinned, being written) are never
in `Q` nor parked, so they are never victims.

Every operation is O(1) amortised: a page enters `S` once per read and
leaves it once (stack pruning), and ghosts are bounded to eight per
resident page (the older half dropped in one pass when over).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator

from kvrelay.cache.eviction.base import EvictionPolicy

_LIR, _HIR, _GHOST = 0, 1, 2


class _Page:
    __slots__ = ("children", "gone", "held", "key", "parent", "state")

    def __init__(self, key: Hashable, state: int) -> None:
        self.key = key
        self.state = state
        self.parent: _Page | None = None
        self.children = 0
        self.held = True
        self.gone = False


class PrefixLIRSPolicy(EvictionPolicy):
    name = "prefix-lirs"
    # Of resident pages, at least this share stays HIR. LIRS's paper uses
    # 1 %; here Q must also hold a session's newest pages until its next turn
    # reads them: 30 % is the share that is never below LRU on both traces of
    # `kvrelay bench cache` (docs/benchmarks.md).
    hir_share = 0.3
    ghost_factor = 8  # non-resident entries of S, per resident page

    def __init__(self) -> None:
        self._resident: dict[Hashable, _Page] = {}
        self._stack: OrderedDict[Hashable, _Page] = OrderedDict()  # S, bottom first
        self._queue: OrderedDict[Hashable, _Page] = OrderedDict()  # Q: evictable HIR leaves
        self._parked: OrderedDict[Hashable, _Page] = OrderedDict()  # evictable HIR inner pages
        self._lir = 0
        self._ghosts = 0

    # -- the interface -------------------------------------------------------------

    def admit(self, key: Hashable, parent: Hashable | None = None) -> None:
        if key in self._resident:
            return
        old = self._stack.get(key)
        reread = old is not None  # a ghost: re-read sooner than the oldest LIR page
        if reread:
            self._ghosts -= 1
        page = _Page(key, _LIR if reread else _HIR)
        self._resident[key] = page
        self._stack[key] = page
        self._stack.move_to_end(key)
        up = self._resident.get(parent) if parent is not None else None
        if up is not None:
            page.parent = up
            up.children += 1
            if up.key in self._queue:
                del self._queue[up.key]
                self._parked[up.key] = up
        if reread:
            self._lir += 1
            self._cap_lir()
        self._bound_ghosts()

    def make_evictable(self, key: Hashable) -> None:
        page = self._resident.get(key)
        if page is not None and page.held:
            page.held = False
            if page.state == _HIR:
                self._place(page, head=False)

    def hold(self, key: Hashable) -> None:
        page = self._resident.get(key)
        if page is not None and not page.held:
            page.held = True
            self._unplace(page)

    def touch(self, key: Hashable) -> None:
        page = self._resident.get(key)
        if page is None:
            return
        stack = self._stack
        if page.state == _LIR:
            bottom = next(iter(stack)) == key
            stack.move_to_end(key)
            if bottom:
                self._prune()
        elif key in stack:  # HIR re-read within the LIR pages' reach: it turns LIR
            stack.move_to_end(key)
            self._unplace(page)
            page.state = _LIR
            self._lir += 1
            self._cap_lir()
        else:
            stack[key] = page
            if key in self._queue:
                self._queue.move_to_end(key)

    def forget(self, key: Hashable) -> None:
        page = self._resident.pop(key, None)
        if page is None:
            return
        self._unplace(page)
        self._stack.pop(key, None)  # HIR pages may have left S
        if page.state == _LIR:
            self._lir -= 1
            self._prune()
        self._gone(page)

    def victim(self) -> Hashable | None:
        while not self._queue and self._lir:
            self._demote_bottom()
        if self._queue:
            _, page = self._queue.popitem(last=False)
        elif self._parked:  # nothing else can go
            _, page = self._parked.popitem(last=False)
        else:
            return None
        del self._resident[page.key]
        if page.key in self._stack:
            ghost = _Page(page.key, _GHOST)
            ghost.held = False
            self._stack[page.key] = ghost  # keeps its place in S
            self._ghosts += 1
        self._gone(page)
        return page.key

    def evictable(self) -> Iterator[Hashable]:
        return iter([k for k, p in self._resident.items() if not p.held])

    def __len__(self) -> int:
        return len(self._resident)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._resident

    # -- internals -----------------------------------------------------------------

    def _place(self, page: _Page, head: bool) -> None:
        """An evictable HIR page: queued if a leaf, parked if inner."""
        if page.held:
            return
        if page.children:
            self._parked[page.key] = page
            return
        self._queue[page.key] = page
        if head:
            self._queue.move_to_end(page.key, last=False)

    def _unplace(self, page: _Page) -> None:
        self._queue.pop(page.key, None)
        self._parked.pop(page.key, None)

    def _gone(self, page: _Page) -> None:
        page.gone = True
        up = page.parent
        if up is None or up.gone:
            return
        up.children -= 1
        if up.children == 0 and up.key in self._parked:
            del self._parked[up.key]
            self._place(up, head=True)

    def _demote_bottom(self) -> None:
        """The oldest LIR page turns HIR; S is pruned down to a LIR page again."""
        self._prune()
        _, page = self._stack.popitem(last=False)
        page.state = _HIR
        self._lir -= 1
        self._place(page, head=False)
        self._prune()

    def _cap_lir(self) -> None:
        if self._lir > (1 - self.hir_share) * len(self._resident):
            self._demote_bottom()

    def _prune(self) -> None:
        """Drop HIR entries below the oldest LIR page (none while no page is LIR:
        S is then every page's recency, so the first re-reads are seen)."""
        stack = self._stack
        while stack and self._lir:
            key, page = next(iter(stack.items()))
            if page.state == _LIR:
                return
            del stack[key]
            if page.state == _GHOST:
                self._ghosts -= 1

    def _bound_ghosts(self) -> None:
        limit = self.ghost_factor * max(len(self._resident), 1)
        if self._ghosts <= limit:
            return
        # Drop the oldest half of the ghosts: one pass per `limit / 2` admissions.
        keep = limit // 2
        for key in [k for k, p in self._stack.items() if p.state == _GHOST]:
            if self._ghosts <= keep:
                break
            del self._stack[key]
            self._ghosts -= 1
        self._prune()
