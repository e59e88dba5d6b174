"""`prefix-lirs`, in Python: the reference of the compiled default (`compiled.py`).

LIRS's reuse-distance order, kept prefix-aware.

LIRS (Jiang and Zhang, 2002) ranks a page by its *inter-reference recency*:
how many other pages were read between its last two reads. Pages with a
short one are LIR and hold 70-98 % of the cache; the rest are HIR, in
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
front: the child just went as the coldest page. A page at the front (there
too: a LIR page taken for finished, `lirs_adapt.py`) goes before the rest
of `Q` unless the head of the rest was read before it; then that head, the
older page, goes first, as LRU would take it. Parked pages are victims
only when nothing else can go. Held pages (pinned, being written) are
never in `Q` nor parked, so they are never victims. Chains are counted by
key: a page's key names its whole prefix, so a parent that leaves and comes
back while a child stays is that child's parent again.

Every operation is O(1) amortised: an entry enters `S` once per read and
leaves once, and ghosts are bounded to eight per resident page (the older
half dropped in one pass when over). `S` is kept in two ordered dicts: its
entries from the oldest LIR page up, and below them those older ones it
keeps for its reach; so the oldest LIR page is the first of the upper part
and LIR pages need no order of their own: a read of a LIR page costs one
lookup and one move, as in LRU (a batch of them is one loop of those; S's
oldest LIR page was among them if it is no longer first). An ordered dict
pays for a node whenever a key enters it, so what needs no order in both
directions is a plain dict, ordered by insertion: the parked pages, and the
pages queued at the front of `Q` (a stack: the page whose child just left
goes next, and a chain leaves tail first), before the rest of `Q`. The
state is plain dicts of keys and small ints, no object per page for the
cyclic collector to scan.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence

from kvrelay.cache.eviction.base import EvictionPolicy
from kvrelay.cache.eviction.lirs_adapt import LIRSAdaptation

# What `S` holds for a key.
_GHOST, _HIR, _LIR = 0, 1, 2


class PrefixLIRSReference(LIRSAdaptation, EvictionPolicy):
    name = "prefix-lirs"
    # The share of resident pages that stays HIR moves (lirs_adapt.py);
    # the paper's LIRS fixes it at 1 %.
    ghost_factor = 8  # ghosts in S per resident page

    def __init__(self) -> None:
        # Resident page -> the resident parent it was admitted under (or None).
        self._resident: dict[Hashable, Hashable | None] = {}
        self._held: set[Hashable] = set()  # resident pages that must not be victims
        # S, oldest first, in two parts: `_top` from the oldest LIR page up
        # (once `_split` has run), `_tail` the older entries.
        self._top: OrderedDict[Hashable, int] = OrderedDict()
        self._tail: OrderedDict[Hashable, int] = OrderedDict()
        self._lirs = 0  # LIR pages
        # Q, the evictable HIR leaves, in two parts: `_front`, the pages queued
        # at its head (a plain dict used as a stack: the last one in is the
        # head), then `_queue`, the rest in order.
        self._front: dict[Hashable, None] = {}
        self._queue: OrderedDict[Hashable, None] = OrderedDict()
        self._parked: dict[Hashable, None] = {}  # evictable HIR inner pages, oldest first
        self._children: dict[Hashable, int] = {}  # key -> resident pages admitted under it
        self._ghosts = 0
        self._ghost_limit = self.ghost_factor
        self._init_adaptation()

    # -- the interface -------------------------------------------------------------

    def admit(self, key: Hashable, parent: Hashable | None = None, evictable: bool = False) -> None:
        resident = self._resident
        if key in resident:
            if evictable:
                self.make_evictable(key)
            return
        self._stamp(key)
        if parent is not None:
            if parent in resident:
                children = self._children
                children[parent] = children.get(parent, 0) + 1
                if self._queue.pop(parent, 0) is None or self._front.pop(parent, 0) is None:
                    self._parked[parent] = None
            else:
                parent = None
        resident[key] = parent
        top, tail = self._top, self._tail
        if key in top:  # in S while not resident: a ghost
            del top[key]
        elif key in tail:
            del tail[key]
        else:
            top[key] = _HIR
            if self._ghosts > self._ghost_limit * len(resident):
                self._drop_ghosts()
            if not evictable:
                self._held.add(key)
            elif key in self._children:
                self._parked[key] = None
            else:
                self._queue[key] = None
            self._expire()
            return
        # A ghost still in S: a short reuse. (Should the demotion below be
        # this page's own, it is queued as any evictable HIR page.)
        if not evictable:
            self._held.add(key)
        self._ghosts -= 1
        top[key] = _LIR
        self._lirs += 1
        if self._lirs > self._lir_share * len(resident):
            self._demote_oldest()
        self._expire()

    def make_evictable(self, key: Hashable) -> None:
        held = self._held
        if key in held:
            held.discard(key)
            if self._top.get(key) != _LIR:
                if key in self._children:
                    self._parked[key] = None
                else:
                    self._queue[key] = None

    def hold(self, key: Hashable) -> None:
        held = self._held
        if key not in held and key in self._resident:
            held.add(key)
            if self._queue.pop(key, 0) is not None and self._front.pop(key, 0) is not None:
                self._parked.pop(key, None)

    def touch(self, key: Hashable) -> None:
        self.touch_many((key,))

    def touch_many(self, keys: Sequence[Hashable]) -> None:
        self._now += 1  # a lookup: one tick of the clock, with hits or none
        if not keys:
            self._expire()
            return
        self._balance(keys)
        resident = self._resident
        for key in keys:
            if key in resident:
                self._stamp(key)
        self._read(keys)
        self._expire()

    def _read(self, keys: Sequence[Hashable]) -> None:
        """LIRS's bookkeeping of a lookup's hits."""
        top = self._top
        oldest = next(iter(top), None)
        if self._lirs and top[oldest] != _LIR:
            self._split()
            oldest = next(iter(top))
        state, move = top.get, top.move_to_end
        start = 0
        if len(keys) < len(top):
            # LIR pages first, as in LRU: one lookup and one move each. Some
            # entry of `_top` is not among the keys, so S's oldest LIR page was
            # read if and only if it is no longer first.
            for key in keys:
                if state(key) == _LIR:
                    move(key)
                else:
                    start = keys.index(key)
                    break
            else:
                if next(iter(top)) is not oldest:
                    self._prune()  # S reached back to that page: shorten it
                return
        shorten = start > 0 and next(iter(top)) is not oldest
        for key in keys[start:]:
            code = state(key)
            if code == _LIR:
                move(key)
                if key == oldest:
                    shorten = True
            else:
                self._read_hir(key, code)
        if shorten:
            self._prune()

    def forget(self, key: Hashable) -> None:
        if key not in self._resident:
            return
        self._held.discard(key)
        self._queue.pop(key, None)
        self._front.pop(key, None)
        self._parked.pop(key, None)
        if self._top.pop(key, None) == _LIR:
            self._lirs -= 1
        self._tail.pop(key, None)
        parent = self._resident.pop(key)
        if parent is not None:
            self._orphan(parent)
        self._release(key)

    def victim(self) -> Hashable | None:
        front, queue = self._front, self._queue
        # The page at the front goes first unless the queue's head was read
        # before it: then the head is the older page, the one LRU would take
        # (a page taken for finished may be a live session's, idle a while).
        last = self._last
        if front and not (queue and last[next(iter(queue))] < last[next(reversed(front))]):
            key = front.popitem()[0]
        elif queue:
            key = queue.popitem(last=False)[0]
        else:
            while not queue and self._lirs:
                self._demote_oldest()  # places pages at Q's tail, never its head
            if queue:
                key = queue.popitem(last=False)[0]
            elif self._parked:  # nothing else can go
                key = next(iter(self._parked))
                del self._parked[key]
            else:
                return None
        top = self._top
        if key in top:
            top[key] = _GHOST  # keeps its place in S
            self._ghosts += 1
        else:
            tail = self._tail
            if key in tail:
                tail[key] = _GHOST
                self._ghosts += 1
        parent = self._resident.pop(key)
        if parent is not None:
            children = self._children
            count = children[parent] - 1
            if count:
                children[parent] = count
            else:
                del children[parent]
                # `parent` has no resident child left: from the parked pages to the front of Q.
                if self._parked.pop(parent, 0) is None:
                    front[parent] = None
                self._release(parent)
        self._release(key)
        return key

    def evictable(self) -> Iterator[Hashable]:
        held = self._held
        return iter([k for k in self._resident if k not in held])

    def __len__(self) -> int:
        return len(self._resident)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._resident

    # -- internals -----------------------------------------------------------------

    def _read_hir(self, key: Hashable, code: int | None) -> None:
        """A page not LIR was read (`code`: its entry in `_top`, if any). A
        resident HIR page in S turns LIR; one out of S enters it and goes to
        the tail of Q."""
        if key not in self._resident:
            return
        top = self._top
        if code is None:
            code = self._tail.pop(key, None)
        if code is None:
            top[key] = _HIR
            queue = self._queue
            if key in queue:
                queue.move_to_end(key)
            elif self._front.pop(key, 0) is None:  # from Q's front to its tail
                queue[key] = None
            return
        top[key] = _LIR
        top.move_to_end(key)
        if self._queue.pop(key, 0) is not None and self._front.pop(key, 0) is not None:
            self._parked.pop(key, None)
        self._lirs += 1
        if self._lirs > self._lir_share * len(self._resident):
            self._demote_oldest()

    def _place(self, key: Hashable) -> None:
        """An evictable HIR page: queued at the tail if a leaf, parked if inner."""
        if key in self._children:
            self._parked[key] = None
        else:
            self._queue[key] = None

    def _orphan(self, parent: Hashable) -> None:
        """A child of `parent` is gone: if it was the last resident one, the
        parent leaves the parked pages for the front of Q."""
        children = self._children
        count = children[parent] - 1
        if count:
            children[parent] = count
            return
        del children[parent]
        self._unpark(parent)
        self._release(parent)

    def _unpark(self, parent: Hashable) -> None:
        """`parent` has no resident child left: from the parked pages to the front of Q."""
        if self._parked.pop(parent, 0) is None:
            self._front[parent] = None

    def _split(self) -> None:
        """Move S's entries below the oldest LIR page from `_top` to `_tail` (S's
        order is unchanged), so that `_top` starts at the oldest LIR page."""
        top = self._top
        below = []
        for key, code in top.items():
            if code == _LIR:
                break
            below.append(key)
        tail = self._tail
        for key in below:
            tail[key] = top.pop(key)

    def _demote_oldest(self) -> None:
        """The LIR page read longest ago turns HIR and leaves S; S is pruned."""
        top, tail = self._top, self._tail
        popitem = top.popitem
        key, code = popitem(last=False)
        while code != _LIR:  # entries below it go to the tail, in order
            tail[key] = code
            key, code = popitem(last=False)
        self._lirs -= 1
        if key not in self._held:
            if key in self._children:
                self._parked[key] = None
            else:
                self._queue[key] = None
        self._prune()

    def _prune(self) -> None:
        """Drop the oldest non-LIR entries of S while S is longer than the resident
        pages and older than the oldest LIR page (none while no page is LIR); then
        `_top` starts at the oldest LIR page."""
        if not self._lirs:
            return
        top, tail = self._top, self._tail
        extra = len(top) + len(tail) - len(self._resident)
        ghosts = 0
        if extra > 0 and tail:  # the tail is the oldest part
            popitem = tail.popitem
            while extra > 0 and tail:
                key, code = popitem(last=False)
                if code == _GHOST:
                    ghosts += 1
                    self._release(key)
                extra -= 1
        if top[next(iter(top))] != _LIR:
            below = []  # `_top`'s entries below its oldest LIR page
            for key, code in top.items():
                if code == _LIR:
                    break
                below.append(key)
            pop = top.pop
            for key in below[:extra] if extra > 0 else ():
                if pop(key) == _GHOST:
                    ghosts += 1
                    self._release(key)
            for key in below[max(extra, 0) :]:
                tail[key] = pop(key)
        self._ghosts -= ghosts

    def _drop_ghosts(self) -> None:
        """The older half of the ghosts leave S, in one pass over it."""
        keep = self.ghost_factor * len(self._resident) // 2
        parts = (self._tail, self._top)
        old = [(k, part) for part in parts for k, code in part.items() if code == _GHOST]
        for key, part in old[: max(0, len(old) - keep)]:
            del part[key]
            self._release(key)
        self._ghosts = min(len(old), keep)
