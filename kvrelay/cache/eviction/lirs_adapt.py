"""What `prefix-lirs` learns while it runs: when a LIR page is finished, and
where the split between LIR and HIR pages should be.

Plain LIRS fixes both. Its LIR part keeps a page until a page with a shorter
reuse distance displaces it, so the pages of sessions that ended (an agent
finished its task: none of its pages is read again) hold the LIR part until
enough new pages have been re-read to push them out; and its HIR share is a
constant, where sessions that take turns over more pages than the cache
holds want almost all of it LIR (a fixed part of them stays and hits every
turn; HIR pages are gone before their next turn) and a stream of one-off
requests with long, irregular reuse wants a longer HIR part, the probation
that new pages pass through.

- **Finished pages.** Each page keeps, in the policy's own clock (one tick
  per lookup, with hits or none; a page admitted is stamped at the current
  tick), when it was last read and its last two reuse intervals. The oldest
  LIR page, once not read for `stale_factor` times the longer of its last
  two intervals, is presumed finished: it turns HIR at the front of Q, the
  next victim unless the head of the rest of Q was read before it (parked
  instead while a later page of its chain stays). A live session's pages can
  wait longer than their last intervals (an agent's tool run that takes
  longer than the last ones), so a page presumed finished does not jump a
  page that has waited longer. Two intervals, so that one short gap does not
  condemn a page whose reuse is irregular. Lookups, not pages, because a
  sharded tier's servers must agree: a request's lookup reaches every server
  that holds a page of its chain, so each counts about the same lookups
  between two turns of a session, where the pages of those lookups that it
  holds vary with how the ring split each chain. Counted in pages, a server
  holding more of the busy sessions' pages would take a quiet session for
  finished sooner than the others, and its eviction would end the session's
  next lookup there whatever the others kept. The LIR pages its last lookup
  read with it follow it whatever their history: they are the later pages
  of its prefix, and a later page is never read without the earlier ones.
  (Judged on their own, the newest of them, with one interval or none,
  would stay LIR and block the test for every page behind it.)
- **The split.** Reads at the two boundaries move it, one page at a time, the
  way ARC and utility-based cache partitioning weigh two parts by their
  marginal hits: a read of one of the `share_band` oldest entries of S's
  upper part that are LIR (a page a smaller LIR part would have lost) moves
  it toward LIR; a read of one of the `share_band` next victims in Q (a page a
  smaller Q would have lost) toward HIR. The HIR share starts at
  `hir_share`, the top of `share_bounds`, and stays within them. The cap
  is for sharded tiers: a server holds a slice of every session's prefix,
  and on a server of a few dozen pages a short run of reads at Q's head
  would carry the split to most of its pages HIR. The session pages that
  excursion demotes and evicts break prefixes that the other servers still
  hold, since a lookup stops at the first server's miss. Most of the time
  the split sits at its floor, near the 1 % that LIRS fixes.

A page's times live as long as the policy tracks its key (resident, in S, or
the parent of a resident page), as do the compiled policy's.

Every step is O(1): the finished-page test looks at S's oldest LIR page only
(a demotion is paid for by the read that put the page in S), and the
boundaries are the first few entries of two ordered lists.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from itertools import islice

_LIR = 2  # as in lirs.py


class LIRSAdaptation:
    """Mixed into `PrefixLIRSReference`: the clock, the finished-page test and
    the moving split (the state lives in the policy's own fields)."""

    hir_share = 0.3  # at the start; then within share_bounds
    share_bounds = (0.02, 0.3)
    share_band = 4
    stale_factor = 1.5

    def _init_adaptation(self) -> None:
        self._now = 0
        self._finished_read = -1
        self._last: dict[Hashable, int] = {}  # key -> clock at its last read
        self._gap: dict[Hashable, int] = {}  # key -> its last reuse interval
        self._gap2: dict[Hashable, int] = {}  # key -> the one before
        self._hir_now = self.hir_share
        self._lir_share = 1 - self.hir_share

    def _stamp(self, key: Hashable) -> None:
        """The key was read (or admitted) now."""
        now = self._now
        last = self._last.get(key)
        if last is not None:
            if last == now:  # twice in one tick: one use
                return
            gap = self._gap.get(key)
            if gap is not None:
                self._gap2[key] = gap
            self._gap[key] = now - last
        self._last[key] = now

    def _release(self, key: Hashable) -> None:
        """The key may have stopped being tracked: its times go with it."""
        if (
            key not in self._resident
            and key not in self._top
            and key not in self._tail
            and key not in self._children
        ):
            self._last.pop(key, None)
            self._gap.pop(key, None)
            self._gap2.pop(key, None)

    def _balance(self, keys: Sequence[Hashable]) -> None:
        """Move the split by the reads among `keys` at its two boundaries."""
        top = self._top
        lir_band: set[Hashable] = set()
        if self._lirs:
            if top[next(iter(top))] != _LIR:
                self._split()
            lir_band = {k for k, code in islice(top.items(), self.share_band) if code == _LIR}
        q_band = set(islice(reversed(self._front), self.share_band))
        if len(q_band) < self.share_band:
            q_band.update(islice(self._queue, self.share_band - len(q_band)))
        lir_reads = sum(1 for k in keys if k in lir_band)
        q_reads = sum(1 for k in keys if k in q_band)
        if lir_reads:
            self._move_split(-lir_reads)
        if q_reads:
            self._move_split(q_reads)

    def _move_split(self, pages: int) -> None:
        """`pages` more of the resident pages to HIR (fewer if negative)."""
        low, high = self.share_bounds
        share = self._hir_now + pages / max(len(self._resident), 1)
        self._hir_now = min(high, max(low, share))
        self._lir_share = 1 - self._hir_now

    def _expire(self) -> None:
        """S's oldest LIR pages, while presumed finished, turn HIR at Q's front."""
        top = self._top
        while self._lirs:
            if top[next(iter(top))] != _LIR:
                self._split()
            key = next(iter(top))
            last = self._last[key]
            if last != self._finished_read:
                gap2 = self._gap2.get(key)
                if gap2 is None:
                    return
                if self._now - last <= self.stale_factor * max(gap2, self._gap[key]):
                    return
                self._finished_read = last
            del top[key]
            self._lirs -= 1
            if key not in self._held:
                if key in self._children:
                    self._parked[key] = None
                else:
                    self._front[key] = None
            self._prune()
