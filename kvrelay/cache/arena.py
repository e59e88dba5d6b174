"""The L2 host arena: fixed-size page slots in memory registered with the transfer engine.

Clients pull (GET) and push (PUT) page bytes one-sided through block handles
the cache server publishes for slots; this module only hands out and frees
slots and exposes their bytes to the server itself (for L3 demotion and
promotion).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvrelay.transfer import Agent, Arena


@dataclass(frozen=True, slots=True)
class ArenaConfig:
    """Capacity in pages, or in bytes (rounded down to whole pages)."""

    page_bytes: int
    capacity_pages: int | None = None
    capacity_bytes: int | None = None

    def num_slots(self) -> int:
        if self.page_bytes <= 0:
            raise ValueError(f"page_bytes must be positive, got {self.page_bytes}")
        if (self.capacity_pages is None) == (self.capacity_bytes is None):
            raise ValueError("give exactly one of capacity_pages and capacity_bytes")
        slots = self.capacity_pages
        if slots is None:
            slots = self.capacity_bytes // self.page_bytes
        if slots <= 0:
            raise ValueError(f"an arena of {self.capacity_bytes} bytes holds no page")
        return slots


class PageArena:
    """`num_slots` page slots of one registered arena; slot i starts at i * page_bytes."""

    def __init__(self, agent: Agent, config: ArenaConfig) -> None:
        self.agent = agent
        self.page_bytes = config.page_bytes
        self.num_slots = config.num_slots()
        self.arena: Arena = agent.allocate_arena(self.num_slots * self.page_bytes)
        # Lowest slots first, so a lightly used arena touches few memory pages.
        self._free = list(range(self.num_slots - 1, -1, -1))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        """A free slot, or None when all are taken (the caller evicts)."""
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        self._check(slot)
        self._free.append(slot)

    def offset(self, slot: int) -> int:
        self._check(slot)
        return slot * self.page_bytes

    def slot_runs(self, slots: Sequence[int], page_runs) -> np.ndarray:
        """`page_runs` of each of `slots`, slot by slot, as (n, 2) uint64 arena
        runs (what `Agent.publish` takes): one array op for a batch's handle."""
        ids = np.asarray(slots, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_slots):
            raise ValueError(f"a slot is outside an arena of {self.num_slots} slots")
        inside = np.asarray(page_runs, dtype=np.uint64).reshape(-1, 2)
        runs = np.empty((len(ids), len(inside), 2), dtype=np.uint64)
        runs[:, :, 0] = ids.astype(np.uint64)[:, None] * np.uint64(self.page_bytes) + inside[:, 0]
        runs[:, :, 1] = inside[:, 1]
        return runs.reshape(-1, 2)

    def view(self, slot: int) -> memoryview:
        """The slot's bytes, writable, without a copy."""
        return self.arena.buffer(self.offset(slot), self.page_bytes)

    def close(self, *, force: bool = False) -> None:
        self.agent.free_arena(self.arena, force=force)

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is outside an arena of {self.num_slots} slots")
