"""The client's write-back queue: copies of one rank's page rectangles waiting to be pushed.

`write()` under write-back copies the rectangle bytes of each page into a
staging arena of the client's agent (the caller may reuse its memory as soon
as `write()` returns) and a background task pushes them later. The staging
arena is registered with the agent, so a push moves the bytes one-sided from
there exactly as a write-through push moves them from the caller's arena.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvrelay.transfer import Agent, Arena


class WriteBackQueue:
    """At most `capacity` pages, oldest first; each in a slot of `rect_bytes` (its runs packed)."""

    def __init__(self, agent: Agent, capacity: int, runs: Sequence[tuple[int, int]]) -> None:
        if capacity <= 0:
            raise ValueError(f"a write-back queue needs room for a page, got {capacity}")
        self.agent = agent
        self.capacity = capacity
        self.runs = list(runs)
        # Where each run of a page's rectangle sits inside its slot.
        self.packed: list[int] = []
        position = 0
        for _, length in self.runs:
            self.packed.append(position)
            position += length
        self.rect_bytes = position
        self.arena: Arena = agent.allocate_arena(capacity * self.rect_bytes)
        self._free = list(range(capacity - 1, -1, -1))
        self.pending: OrderedDict[bytes, int] = OrderedDict()  # key -> slot

    def __len__(self) -> int:
        return len(self.pending)

    @property
    def full(self) -> bool:
        return not self._free

    def add(self, key: bytes, src: Arena, page_offset: int) -> bool:
        """Copy the rectangle of the page at `page_offset` of `src`; False when full.

        A key already waiting is not copied again (keys name content).
        """
        if key in self.pending:
            return True
        if not self._free:
            return False
        slot = self._free.pop()
        base = slot * self.rect_bytes
        for (offset, length), packed in zip(self.runs, self.packed, strict=True):
            start = page_offset + offset
            self.arena.tensor[base + packed : base + packed + length].copy_(
                src.tensor[start : start + length]
            )
        self.pending[key] = slot
        return True

    def copy_out(self, key: bytes, dest: Arena, page_offset: int) -> bool:
        """Copy a waiting page's rectangle into `dest` at its page layout; False if absent."""
        slot = self.pending.get(key)
        if slot is None:
            return False
        base = slot * self.rect_bytes
        for (offset, length), packed in zip(self.runs, self.packed, strict=True):
            start = page_offset + offset
            dest.tensor[start : start + length].copy_(
                self.arena.tensor[base + packed : base + packed + length]
            )
        return True

    def local_offsets(self, key: bytes) -> list[int]:
        """Offsets in the staging arena of the key's runs, in rectangle order."""
        base = self.pending[key] * self.rect_bytes
        return [base + packed for packed in self.packed]

    def remove(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            slot = self.pending.pop(key, None)
            if slot is not None:
                self._free.append(slot)

    def close(self) -> None:
        self.pending.clear()
        self.agent.free_arena(self.arena)
