"""One cache server's pages: the index over L2 arena slots, backed by an optional L3 store.

The index holds only pages resident in L2. A page evicted from L2 is demoted
to L3 (write-back, the default) or was already put there when it sealed
(write-through); a lookup that runs out of L2 hits asks L3 for the next pages
and promotes what it finds into L2 before answering. L3 is never indexed: a
shared valkey store is filled by other servers too, and the file store evicts
on its own.

Synchronous and single-threaded: the server process calls it from its event
loop (L3 calls block for at most the store's short timeout).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvrelay.cache.arena import PageArena
from kvrelay.cache.eviction import DEFAULT_POLICY, make_policy
from kvrelay.cache.index import LookupResult, PageEntry, PageIndex, PinLease
from kvrelay.cache.l3 import L3Store
from kvrelay.cache.policy import WritePolicy


@dataclass(slots=True)
class TierStats:
    lookups: int = 0
    lookup_pages: int = 0  # keys asked for
    hit_pages: int = 0  # pages answered (L2 and promoted)
    reserved_pages: int = 0
    sealed_pages: int = 0
    evictions: int = 0
    demotions: int = 0
    clean_evictions: int = 0  # evicted pages L3 already held (promoted): not written again
    promotions: int = 0
    no_room: int = 0  # reservations refused: every slot pinned or being written
    board_reads: int = 0  # reads clients made off the slot board (lookups without a lease)


@dataclass(frozen=True, slots=True)
class TierConfig:
    l3_policy: WritePolicy = WritePolicy.WRITE_BACK
    # A lookup asks L3 for at most this many pages past its L2 hits.
    max_promote: int = 256
    # Which L2 page goes first (kvrelay.cache.eviction.POLICIES).
    eviction: str = DEFAULT_POLICY

    def __post_init__(self) -> None:
        object.__setattr__(self, "l3_policy", WritePolicy.of(self.l3_policy, "l3_policy"))
        make_policy(self.eviction)  # refuse an unknown name here, not at the first page


# Misses a lookup remembers with the hit before them, so the reservation that
# follows can name each new page's parent; older ones are dropped first.
_PARENT_HINTS = 4096


class CacheTier:
    def __init__(
        self,
        arena: PageArena,
        l3: L3Store | None = None,
        config: TierConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.arena = arena
        self.l3 = l3
        self.config = config or TierConfig()
        self.index = PageIndex(arena.page_bytes, clock, make_policy(self.config.eviction))
        self.stats = TierStats()
        # First missed key of a lookup -> the key before it (see _PARENT_HINTS).
        self._parent_hints: dict[bytes, bytes] = {}
        # L2 pages whose bytes L3 holds already (they were promoted from it; a
        # sealed page never changes): evicting one writes nothing.
        self._clean: set[bytes] = set()

    def lookup(
        self, keys: Sequence[bytes], lease_s: float | None = None, namespace: bytes = b""
    ) -> LookupResult:
        """Longest sealed prefix of `keys`, promoting from L3 past the L2 hits."""
        self.stats.lookups += 1
        self.stats.lookup_pages += len(keys)
        # One read per lookup: the policy must not count the check as a use too.
        hits = self.index.peek(keys)
        asked_to = hits  # keys before this were in L2 or asked of L3
        starved = False
        if self.l3 is not None and hits < len(keys):
            # The L2 hits are pinned while L3 pages come up behind them, so
            # that making room for those cannot evict them.
            guard = self.index.pin(keys[:hits], lease_s=60.0) if hits else None
            parent = keys[hits - 1] if hits else None
            window = keys[hits : hits + self.config.max_promote]
            starved = self._promote(window, namespace, parent)
            asked_to = hits + len(window)
            if guard is not None:
                self.index.release(guard.lease_id)
        result = self.index.lookup(keys, lease_s)
        # A chain longer than L2 (or than one promotion) is answered in turns:
        # the reader takes these pages, releases them and asks from the next.
        if result.hits < len(keys) and (starved or result.hits >= asked_to > hits):
            result = dataclasses.replace(result, more=True)
        self.stats.hit_pages += result.hits
        if 0 < result.hits < len(keys):
            self._hint_parent(keys[result.hits], keys[result.hits - 1])
        return result

    def touch(self, keys: Sequence[bytes]) -> int:
        """A read a client made off the slot board, after the fact: the sealed
        prefix it finds counts as a lookup's hits and as a use of each page."""
        self.stats.lookups += 1
        self.stats.board_reads += 1
        self.stats.lookup_pages += len(keys)
        hits = self.index.lookup(keys).hits
        self.stats.hit_pages += hits
        return hits

    def reserve(
        self, keys: Sequence[bytes], lease_s: float, namespace: bytes = b""
    ) -> tuple[list[int | None], PinLease]:
        """Slots for writers to fill, pinned under one lease.

        Per key: its slot, or None when the page is already sealed (nothing to
        write) or no slot could be freed. A key already reserved by another
        writer gets the same slot: rectangles of one page may come from
        several writers. `keys` are in chain order (a request's pages on this
        server), so the key before a page is the parent the policy keeps
        while the page stays; the first one's comes from the lookup that
        missed it.
        """
        slots: list[int | None] = []
        pinned: list[bytes] = []
        before = self._parent_hints.pop(keys[0], None) if keys else None
        for key in keys:
            entry = self.index.get(key)
            if entry is not None and entry.sealed:
                slots.append(None)
                before = key
                continue
            if entry is None:
                slot = self._take_slot(keep=pinned)
                if slot is None:
                    self.stats.no_room += 1
                    slots.append(None)
                    before = None
                    continue
                parent = before if before is not None and before in self.index else None
                entry = self.index.insert(key, slot, namespace=namespace, parent=parent)
                self.stats.reserved_pages += 1
            before = key
            slots.append(entry.slot)
            pinned.append(key)
        return slots, self.index.pin(pinned, lease_s)

    def refused_for_room(self, keys: Sequence[bytes], slots: Sequence[int | None]) -> bool:
        """Whether `reserve` refused some of `keys` (no slot, not sealed) where
        room can be made once this reservation is released: an L3 takes the
        pages that then make way, so a long chain is written in turns."""
        if self.l3 is None:
            return False
        return any(
            slot is None and not ((e := self.index.get(key)) is not None and e.sealed)
            for key, slot in zip(keys, slots, strict=True)
        )

    def commit(self, key: bytes, runs: Sequence[tuple[int, int]]) -> bool:
        """Record `runs` (page offsets) of a reserved page as written; True once sealed."""
        was_sealed = self.index.get(key) is not None and self.index.get(key).sealed
        sealed = self.index.record_runs(key, runs)
        if sealed and not was_sealed:
            self.stats.sealed_pages += 1
            if self.l3 is not None and self.config.l3_policy is WritePolicy.WRITE_THROUGH:
                entry = self.index.get(key)
                self.l3.put(key, self.arena.view(entry.slot), entry.namespace)
        return sealed

    def release(self, lease_id: int) -> bool:
        return self.index.release(lease_id)

    def flush(self, namespace: bytes | None = None) -> tuple[int, int]:
        """Drop the pages of one namespace (or all) from L2 and L3; return how many from each.

        L2 keeps pages pinned by readers or writers (they go when unpinned, by
        eviction). L3 files pages under their namespace, so its flush also
        finds pages that only L3 holds; a pinned L2 page loses its L3 copy.
        """

        def chosen(entry: PageEntry) -> bool:
            return namespace is None or entry.namespace == namespace

        dropped = self.index.evict(len(self.index), where=chosen)
        dropped += self.index.drop_abandoned(where=chosen)
        for entry in dropped:
            self.arena.free(entry.slot)
            self._clean.discard(entry.key)
        # Pinned pages that stay lose their L3 copy below.
        self._clean -= {e.key for e in self.index.entries() if chosen(e)}
        l3_dropped = self.l3.flush(namespace) if self.l3 is not None else 0
        return len(dropped), l3_dropped

    def demote_all(self) -> int:
        """Write every sealed page to L3 (write-back, at shutdown); return how many went in.

        Pages stay in L2; with write-through they are there already.
        """
        if self.l3 is None or self.config.l3_policy is not WritePolicy.WRITE_BACK:
            return 0
        stored = 0
        for entry in list(self.index.entries()):
            if not entry.sealed or entry.key in self._clean:
                continue
            view = self.arena.view(entry.slot)
            if self.l3.put(entry.key, view, entry.namespace):
                stored += 1
        self.stats.demotions += stored
        return stored

    # -- internals ---------------------------------------------------------------------

    def _take_slot(self, keep: Sequence[bytes] = ()) -> int | None:
        """A free slot, evicting one page if need be; `keep`: this call's own
        reservations (not pinned yet), which are not abandoned."""
        slot = self.arena.alloc()
        if slot is not None:
            return slot
        # With an L3 a page the policy keeps for a held later page of its
        # chain can go too: it is demoted (or there already), and promotion
        # brings it back; without one, refusing keeps the prefix those need.
        for entry in self.index.evict(1, inner=self.l3 is not None):
            self.stats.evictions += 1
            self._demote(entry)
            self.arena.free(entry.slot)
            return self.arena.alloc()
        # Nothing evictable: reclaim slots of writers whose leases ran out.
        mine = set(keep)
        for entry in self.index.drop_abandoned(where=lambda e: e.key not in mine):
            self.arena.free(entry.slot)
        return self.arena.alloc()

    def _demote(self, entry: PageEntry) -> None:
        if entry.key in self._clean:
            self._clean.discard(entry.key)
            self.stats.clean_evictions += 1
            return
        if self.l3 is None or self.config.l3_policy is not WritePolicy.WRITE_BACK:
            return
        if self.l3.put(entry.key, self.arena.view(entry.slot), entry.namespace):
            self.stats.demotions += 1

    def _hint_parent(self, key: bytes, parent: bytes) -> None:
        hints = self._parent_hints
        hints.pop(key, None)
        hints[key] = parent
        if len(hints) > _PARENT_HINTS:
            del hints[next(iter(hints))]

    def _promote(self, keys: Sequence[bytes], namespace: bytes, parent: bytes | None) -> bool:
        """Bring the leading run of `keys` found in L3 into L2 slots, sealed
        (`parent`: the L2 hit before them). True when it stopped for want of
        a free slot (every one pinned), not at a page L3 lacks."""
        # Pages L2 holds already (this server owned them before) come back
        # from L3 as None; making room for an earlier page may demote one.
        in_l2 = {k for k in keys if k in self.index}
        pages = self.l3.get_many(keys, namespace)
        # Pin what is promoted so promoting page i+1 cannot evict page i.
        leases: list[int] = []
        starved = False
        for key, page in zip(keys, pages, strict=True):
            resident = self.index.get(key)
            if resident is not None:
                if not resident.sealed:
                    break  # an unsealed reservation
                # In L2 already: the run goes on, and the page is pinned like
                # a promoted one meanwhile.
                leases.append(self.index.pin([key], lease_s=60.0).lease_id)
                continue
            if page is None and key in in_l2:
                page = self.l3.get(key, namespace)  # demoted by this promotion
            if page is None or len(page) != self.arena.page_bytes:
                break
            slot = self._take_slot()
            if slot is None:
                starved = True
                break
            self.arena.view(slot)[:] = page
            if parent is not None and parent not in self.index:
                parent = None
            self.index.insert(key, slot, sealed=True, namespace=namespace, parent=parent)
            parent = key
            self._clean.add(key)
            leases.append(self.index.pin([key], lease_s=60.0).lease_id)
            self.stats.promotions += 1
        # Unpin at once: the lookup that follows pins what it answers.
        for lease_id in leases:
            self.index.release(lease_id)
        return starved
