"""`prefix-lirs`, the default: LIRS's reuse-distance order, kept prefix-aware.

LIRS (Jiang and Zhang, 2002) ranks a page by its *inter-reference recency*:
how many other pages were read between its last two reads. Pages with a
short one are LIR and hold at most 70 % of the cache; the rest are HIR, in
a FIFO `Q` whose head is the next victim. A recency stack `S` remembers
recent reads, of resident pages and of evicted ones (ghosts: only the key):
a HIR page read again while still in `S` turns LIR, and when LIR pages are
over their share the one read longest ago turns HIR. `S` reaches back to
the oldest LIR page's last read, and at least as many entries as there are
resident pages, so a page re-read within about one cache's worth of other
reads is seen even while the hottest pages (a shared system prompt, read by
every request) are all that is LIR.

This is how frequency enters: a page read once goes through `Q` and out (a
finished one-off request's tail, in the order pages came, as LRU would); a
page read again soon stays LIR; and sessions that take turns over a set of
pages larger than the cache keep a fixed part of it instead of losing all of
it, as LRU does.

Prefix-awareness: a HIR page with a resident child (a later page of its
chain) is parked out of `Q` until its last child leaves, then queues at the
head: the child just went as the coldest page. Parked pages are victims
only when nothing else can go. Held pages (pinned, being written) are
never in `Q` nor parked, so they are never victims.

Every operation is O(1) amortised: an entry enters `S` once per read and
leaves once, and ghosts are bounded to eight per resident page (the older
half dropped in one pass when over).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence

from kvrelay.cache.eviction.base import EvictionPolicy


class _Page:
    __slots__ = ("children", "gone", "held", "key", "lir", "parent")

    def __init__(self, key: Hashable, lir: bool, parent: _Page | None) -> None:
        self.key = key
        self.lir = lir
        self.parent = parent
        self.children = 0
        self.held = True
        self.gone = False


_GHOST = _Page(None, False, None)  # S's entry for an evicted page


class PrefixLIRSPolicy(EvictionPolicy):
    name = "prefix-lirs"
    # At least this share of resident pages stays HIR. The paper's LIRS
    # uses 1 %; here Q must also hold a session's newest pages until its
    # next turn reads them (docs/benchmarks.md, `kvrelay bench cache`).
    hir_share = 0.3
    ghost_factor = 8  # ghosts in S per resident page

    def __init__(self) -> None:
        self._resident: dict[Hashable, _Page] = {}
        self._stack: OrderedDict[Hashable, _Page] = OrderedDict()  # S, oldest first
        self._lir: OrderedDict[Hashable, _Page] = OrderedDict()  # LIR pages, oldest first
        self._queue: OrderedDict[Hashable, _Page] = OrderedDict()  # Q: evictable HIR leaves
        self._parked: OrderedDict[Hashable, _Page] = OrderedDict()  # evictable HIR inner pages
        self._ghosts = 0

    # -- the interface -------------------------------------------------------------

    def admit(self, key: Hashable, parent: Hashable | None = None) -> None:
        resident = self._resident
        if key in resident:
            return
        up = resident.get(parent) if parent is not None else None
        stack = self._stack
        reread = stack.pop(key, None) is not None  # a ghost still in S
        page = _Page(key, reread, up)
        resident[key] = page
        stack[key] = page
        if up is not None:
            up.children += 1
            if up.key in self._queue:
                del self._queue[up.key]
                self._parked[up.key] = up
        if reread:
            self._ghosts -= 1
            self._lir[key] = page
            self._cap_lir()
        elif self._ghosts > self.ghost_factor * len(resident):
            self._drop_ghosts()

    def make_evictable(self, key: Hashable) -> None:
        page = self._resident.get(key)
        if page is not None and page.held:
            page.held = False
            if not page.lir:
                self._place(page, head=False)

    def hold(self, key: Hashable) -> None:
        page = self._resident.get(key)
        if page is not None and not page.held:
            page.held = True
            self._queue.pop(key, None)
            self._parked.pop(key, None)

    def touch(self, key: Hashable) -> None:
        self.touch_many((key,))

    def touch_many(self, keys: Sequence[Hashable]) -> None:
        resident, lir, stack = self._resident, self._lir, self._stack
        lir_move, stack_move = lir.move_to_end, stack.move_to_end
        oldest = next(iter(lir), None)
        for key in keys:
            page = resident.get(key)
            if page is None:
                continue
            if page.lir:
                lir_move(key)
                stack_move(key)
                if key == oldest:  # S reached back to this page: shorten it
                    self._prune()
                    oldest = next(iter(lir), None)
                continue
            if key in stack:  # a HIR page re-read while in S: it turns LIR
                stack_move(key)
                self._queue.pop(key, None)
                self._parked.pop(key, None)
                page.lir = True
                lir[key] = page
                self._cap_lir()
                oldest = next(iter(lir), None)
            else:
                stack[key] = page
                if key in self._queue:
                    self._queue.move_to_end(key)

    def forget(self, key: Hashable) -> None:
        page = self._resident.pop(key, None)
        if page is None:
            return
        self._queue.pop(key, None)
        self._parked.pop(key, None)
        self._stack.pop(key, None)
        if page.lir:
            del self._lir[key]
        self._gone(page)

    def victim(self) -> Hashable | None:
        while not self._queue and self._lir:
            self._demote_oldest()
        if self._queue:
            _, page = self._queue.popitem(last=False)
        elif self._parked:  # nothing else can go
            _, page = self._parked.popitem(last=False)
        else:
            return None
        key = page.key
        del self._resident[key]
        if key in self._stack:
            self._stack[key] = _GHOST  # keeps its place in S
            self._ghosts += 1
        self._gone(page)
        return key

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

    def _gone(self, page: _Page) -> None:
        page.gone = True
        up = page.parent
        if up is None or up.gone:
            return
        up.children -= 1
        if up.children == 0 and up.key in self._parked:
            del self._parked[up.key]
            self._place(up, head=True)

    def _cap_lir(self) -> None:
        if len(self._lir) > (1 - self.hir_share) * len(self._resident):
            self._demote_oldest()

    def _demote_oldest(self) -> None:
        """The LIR page read longest ago turns HIR and leaves S."""
        key, page = self._lir.popitem(last=False)
        page.lir = False
        del self._stack[key]
        self._place(page, head=False)
        self._prune()

    def _prune(self) -> None:
        """Drop the oldest non-LIR entries of S while S is longer than the resident
        pages and older than the oldest LIR page (none while no page is LIR)."""
        if not self._lir:
            return
        stack = self._stack
        extra = len(stack) - len(self._resident)
        ghosts = 0
        while extra > 0:
            key, page = stack.popitem(last=False)
            if page.lir:  # the oldest LIR page: it stays at the bottom
                stack[key] = page
                stack.move_to_end(key, last=False)
                break
            extra -= 1
            if page is _GHOST:
                ghosts += 1
        self._ghosts -= ghosts

    def _drop_ghosts(self) -> None:
        """The older half of the ghosts leave S, in one pass over it."""
        keep = self.ghost_factor * len(self._resident) // 2
        old = [k for k, p in self._stack.items() if p is _GHOST]
        for key in old[: max(0, len(old) - keep)]:
            del self._stack[key]
        self._ghosts = min(len(old), keep)
