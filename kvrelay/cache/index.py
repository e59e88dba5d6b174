"""The page index of one cache server (DESIGN.md section 5).

Maps a page key to the L2 arena slot that holds its bytes (L3 is probed by
the tier, never indexed: `kvrelay.cache.tier`), tracks which byte runs of
the page have been written so a page is sealed only once every rectangle is
in (DESIGN.md section 3), and holds pins and leases. Which sealed, unpinned
page goes first is its eviction policy's choice (`kvrelay.cache.eviction`):
the index tells the policy what happens to each page.

The index moves no bytes and owns no memory: the arena and the L3 stores act
on what it returns (slots to free, pages to demote).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvrelay.cache.eviction import EvictionPolicy, make_policy
from kvrelay.layout import ModelKVSpec, Rectangle

KEY_BYTES = 32  # a sha256 page key (kvrelay.layout.keys)


class CacheIndexError(LookupError):
    """A request the index cannot honour (unknown key, pinned page, bad run)."""


@dataclass(slots=True)
class PageEntry:
    key: bytes
    slot: int  # the L2 arena slot of its bytes
    page_bytes: int
    # Disjoint, sorted [start, end) byte intervals written so far.
    filled: list[tuple[int, int]] = field(default_factory=list)
    sealed: bool = False
    pins: int = 0
    # The namespace digest its writer or promoter named (b"": unknown); keys
    # are opaque digests, so this is what lets admin flush one tenant.
    namespace: bytes = b""


@dataclass(slots=True)
class PinLease:
    """Pages of the index pinned for a reader or writer (never evicted) until
    released or `expiry` (the tier's clock). Not a transfer lease: the cache
    server publishes a `RunLease` of the same length for the pages' bytes."""

    lease_id: int
    keys: tuple[bytes, ...]
    expiry: float


@dataclass(frozen=True, slots=True)
class LookupResult:
    """The hit prefix of a lookup: entries in key order and, if pinned, their lease.

    `more`: the answer stopped short of what the tier may hold (L2 had no room
    to bring more pages up from L3); a reader that has taken these pages and
    released them asks again from the first key not answered.
    """

    entries: tuple[PageEntry, ...]
    lease: PinLease | None
    more: bool = False

    @property
    def hits(self) -> int:
        return len(self.entries)

    @property
    def slots(self) -> list[int]:
        return [e.slot for e in self.entries]


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise CacheIndexError(f"a page key is {KEY_BYTES} bytes, got {key!r:.80}")


def _add_interval(intervals: list[tuple[int, int]], start: int, end: int) -> None:
    """Insert [start, end) into sorted disjoint `intervals`, merging overlaps and neighbours."""
    merged: list[tuple[int, int]] = []
    placed = False
    for lo, hi in intervals:
        if hi < start:
            merged.append((lo, hi))
        elif end < lo:
            if not placed:
                merged.append((start, end))
                placed = True
            merged.append((lo, hi))
        else:
            start, end = min(start, lo), max(end, hi)
    if not placed:
        merged.append((start, end))
    intervals[:] = merged


class PageIndex:
    """Page key -> L2 slot, seal state, pins and leases, in an eviction policy's order.

    `clock` returns seconds (monotonic by default); tests pass a fake one.
    Expired leases are dropped lazily at the start of every public call.
    `policy` defaults to a fresh `kvrelay.cache.eviction.DEFAULT_POLICY`.
    """

    def __init__(
        self,
        page_bytes: int,
        clock: Callable[[], float] = time.monotonic,
        policy: EvictionPolicy | None = None,
    ) -> None:
        if page_bytes <= 0:
            raise ValueError(f"page_bytes must be positive, got {page_bytes}")
        self.page_bytes = page_bytes
        self._clock = clock
        self._entries: dict[bytes, PageEntry] = {}
        # Sealed, unpinned pages are the policy's evictable set; the rest it holds.
        self.policy = policy if policy is not None else make_policy()
        self._leases: dict[int, PinLease] = {}
        self._expiries: list[tuple[float, int]] = []
        self._lease_ids = itertools.count(1)
        # A `SlotBoard` kept in step: sealed pages published, removed ones withdrawn.
        self.board = None

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> PageEntry | None:
        return self._entries.get(key)

    def entries(self) -> Iterable[PageEntry]:
        return self._entries.values()

    @property
    def num_leases(self) -> int:
        self.expire_leases()
        return len(self._leases)

    # -- pages -------------------------------------------------------------------------

    def insert(
        self,
        key: bytes,
        slot: int,
        *,
        sealed: bool = False,
        namespace: bytes = b"",
        parent: bytes | None = None,
    ) -> PageEntry:
        """Add a page at `slot`, empty (to be written) or already sealed (promoted).

        `parent`: the indexed page before it in its chain, if the caller knows
        it (a prefix-aware policy keeps the parent while this page stays).
        """
        _check_key(key)
        self.expire_leases()
        if key in self._entries:
            raise CacheIndexError(f"page {key.hex()[:16]} is already indexed")
        entry = PageEntry(key, slot, self.page_bytes, namespace=namespace)
        self._entries[key] = entry
        if sealed:  # unpinned: evictable at once
            entry.filled = [(0, self.page_bytes)]
            entry.sealed = True
            if self.board is not None:
                self.board.publish(key, slot)
        self.policy.admit(key, parent, sealed)
        return entry

    def record_runs(self, key: bytes, runs: Iterable[tuple[int, int]]) -> bool:
        """Mark `runs` ((offset, length) inside the page) written; return whether sealed."""
        entry = self._require(key)
        self.expire_leases()
        if entry.sealed:
            return True
        for offset, length in runs:
            if length <= 0 or offset < 0 or offset + length > self.page_bytes:
                raise CacheIndexError(
                    f"run ({offset}, {length}) is outside a page of {self.page_bytes} bytes"
                )
            _add_interval(entry.filled, offset, offset + length)
        if entry.filled == [(0, self.page_bytes)]:
            self._seal(entry)
        return entry.sealed

    def record_rectangle(self, key: bytes, spec: ModelKVSpec, rect: Rectangle) -> bool:
        """Mark a writer's rectangle of the page written; return whether the page is sealed."""
        if spec.page_bytes != self.page_bytes:
            raise CacheIndexError(
                f"spec pages are {spec.page_bytes} bytes, index {self.page_bytes}"
            )
        return self.record_runs(key, rect.byte_runs(spec))

    def remove(self, key: bytes) -> PageEntry:
        """Drop a page from the index; refused while it is pinned."""
        entry = self._require(key)
        self.expire_leases()
        if entry.pins:
            raise CacheIndexError(f"page {key.hex()[:16]} is pinned {entry.pins} times")
        del self._entries[key]
        self._gone(entry)
        self.policy.forget(key)
        return entry

    def evict(
        self,
        count: int,
        where: Callable[[PageEntry], bool] | None = None,
        inner: bool = False,
    ) -> list[PageEntry]:
        """Remove up to `count` sealed, unpinned pages in the policy's order.

        `where` restricts the choice (e.g. to one namespace; a scan of every
        evictable page, in no promised order); the caller frees or demotes
        what comes back. `inner`: when the policy keeps the rest for held
        pages of their chains, take those too (`victim_inner`: a caller that
        demotes them to L3 loses nothing).
        """
        self.expire_leases()
        victims: list[PageEntry] = []
        if where is None:
            while len(victims) < count:
                key = self.policy.victim()
                if key is None and inner:
                    key = self.policy.victim_inner()
                if key is None:
                    break
                victims.append(self._entries.pop(key))
                self._gone(victims[-1])
            return victims
        for key in self.policy.evictable():
            if len(victims) >= count:
                break
            entry = self._entries[key]
            if where(entry):
                victims.append(entry)
        for entry in victims:
            del self._entries[entry.key]
            self._gone(entry)
            self.policy.forget(entry.key)
        return victims

    def drop_abandoned(self, where: Callable[[PageEntry], bool] | None = None) -> list[PageEntry]:
        """Remove unsealed, unpinned pages: reservations whose writers' leases ran out."""
        self.expire_leases()
        dropped = [
            e
            for e in self._entries.values()
            if not e.sealed and not e.pins and (where is None or where(e))
        ]
        for entry in dropped:
            del self._entries[entry.key]
            self.policy.forget(entry.key)
        return dropped

    # -- lookups and leases ------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes], lease_s: float | None = None) -> LookupResult:
        """The longest run of consecutive sealed pages from the start of `keys`.

        Hits count as a use (the policy's `touch`). With `lease_s`, the hits are pinned under one
        lease that expires after `lease_s` seconds unless released first.
        """
        self.expire_leases()
        hits: list[PageEntry] = []
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or not entry.sealed:
                break
            hits.append(entry)
        # Called with no hits too: a policy may count lookups as its clock.
        self.policy.touch_many(keys[: len(hits)])
        lease = None
        if lease_s is not None and hits:
            lease = self._grant([e.key for e in hits], lease_s)
        return LookupResult(tuple(hits), lease)

    def peek(self, keys: Sequence[bytes]) -> int:
        """How many pages `lookup(keys)` would answer, without it counting as a use."""
        hits = 0
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or not entry.sealed:
                break
            hits += 1
        return hits

    def pin(self, keys: Sequence[bytes], lease_s: float) -> PinLease:
        """Pin indexed pages (sealed or not, e.g. reservations being written) under a lease."""
        self.expire_leases()
        for key in keys:
            self._require(key)
        return self._grant(list(keys), lease_s)

    def lease(self, lease_id: int) -> PinLease | None:
        """The live lease of that id, or None once released or expired."""
        self.expire_leases()
        return self._leases.get(lease_id)

    def seconds_left(self, lease: PinLease) -> float:
        return lease.expiry - self._clock()

    def release(self, lease_id: int) -> bool:
        """Unpin a lease's pages; False if it is unknown or has already expired."""
        self.expire_leases()
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self._unpin(lease)
        return True

    def extend(self, lease_id: int, lease_s: float) -> bool:
        """Push a live lease's expiry to `lease_s` from now; False if it is gone."""
        self.expire_leases()
        lease = self._leases.get(lease_id)
        if lease is None:
            return False
        lease.expiry = self._clock() + lease_s
        heapq.heappush(self._expiries, (lease.expiry, lease_id))
        return True

    def expire_leases(self) -> list[int]:
        """Unpin every lease whose expiry has passed; return their ids."""
        now = self._clock()
        expired = []
        while self._expiries and self._expiries[0][0] <= now:
            expiry, lease_id = heapq.heappop(self._expiries)
            lease = self._leases.get(lease_id)
            # A stale heap entry: released, or extended to a later expiry.
            if lease is None or lease.expiry != expiry:
                continue
            del self._leases[lease_id]
            self._unpin(lease)
            expired.append(lease_id)
        return expired

    # -- internals ---------------------------------------------------------------------

    def _require(self, key: bytes) -> PageEntry:
        _check_key(key)
        entry = self._entries.get(key)
        if entry is None:
            raise CacheIndexError(f"page {key.hex()[:16]} is not indexed")
        return entry

    def _gone(self, entry: PageEntry) -> None:
        if self.board is not None and entry.sealed:
            self.board.withdraw(entry.key, entry.slot)

    def _seal(self, entry: PageEntry) -> None:
        entry.sealed = True
        if self.board is not None:
            self.board.publish(entry.key, entry.slot)
        if not entry.pins:
            self.policy.make_evictable(entry.key)

    def _grant(self, keys: list[bytes], lease_s: float) -> PinLease:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        lease = PinLease(next(self._lease_ids), tuple(keys), self._clock() + lease_s)
        for key in keys:
            entry = self._entries[key]
            entry.pins += 1
            self.policy.hold(key)
        self._leases[lease.lease_id] = lease
        heapq.heappush(self._expiries, (lease.expiry, lease.lease_id))
        return lease

    def _unpin(self, lease: PinLease) -> None:
        for key in lease.keys:
            entry = self._entries.get(key)
            if entry is None:
                continue
            entry.pins -= 1
            if entry.pins == 0 and entry.sealed:
                # A reader was using the page until now: that is its last use.
                self.policy.make_evictable(key)
