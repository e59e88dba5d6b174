"""Where a cache client's pages sit locally, and who moves them to and from slots.

A `CacheClient` finds or reserves slots on each server and gets a block
handle of its runs of those pages; a `PageMover` then moves the bytes. The
usual one is `ArenaPages`: the pages sit in a registered arena and the
transfer agent copies them (one-sided read or write, the same-host fast path
included). An engine adapter whose own copy can go straight between its KV
pool and the slots (a gather into the server's mapped arena) brings a mover
of its own, and the page moves once instead of twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from kvrelay.transfer import Arena, BlockHandle

if TYPE_CHECKING:
    from kvrelay.cache.client import CacheClient


class PageMover(Protocol):
    """The pages of one client call. `positions` index the call's keys;
    `handle` holds the client's runs (`client.runs`) of each of those pages,
    in that order, on one server."""

    def shifted(self, start: int) -> PageMover:
        """The same pages seen from the call's `start`-th key on."""
        ...

    async def pull(
        self, client: CacheClient, handle: BlockHandle, positions: Sequence[int]
    ) -> None:
        """The handle's bytes -> local pages `positions`."""
        ...

    async def push(
        self, client: CacheClient, handle: BlockHandle, positions: Sequence[int]
    ) -> None:
        """Local pages `positions` -> the handle's slots."""
        ...


class ArenaPages:
    """Pages in an arena: page i at `page_offsets[i]` (the client's runs at
    their offsets within it), or page i's runs at `run_offsets[i]`."""

    def __init__(
        self,
        arena: Arena,
        page_offsets: Sequence[int] | None = None,
        *,
        run_offsets: Sequence[Sequence[int]] | None = None,
    ) -> None:
        if (page_offsets is None) == (run_offsets is None):
            raise ValueError("give page_offsets or run_offsets")
        self.arena, self.page_offsets, self.run_offsets = arena, page_offsets, run_offsets

    def shifted(self, start: int) -> ArenaPages:
        if self.page_offsets is not None:
            return ArenaPages(self.arena, self.page_offsets[start:])
        return ArenaPages(self.arena, run_offsets=self.run_offsets[start:])

    def _offsets(self, client: CacheClient, positions: Sequence[int]) -> list[int]:
        if self.run_offsets is not None:
            return [o for p in positions for o in self.run_offsets[p]]
        pages = self.page_offsets
        return [pages[p] + offset for p in positions for offset, _ in client.runs]

    async def pull(
        self, client: CacheClient, handle: BlockHandle, positions: Sequence[int]
    ) -> None:
        await self._move(client, handle, positions, read=True)

    async def push(
        self, client: CacheClient, handle: BlockHandle, positions: Sequence[int]
    ) -> None:
        await self._move(client, handle, positions, read=False)

    async def _move(self, client: CacheClient, handle, positions, *, read: bool) -> None:
        move = client.agent.read if read else client.agent.write
        await move(handle, self.arena, self._offsets(client, positions),
                   namespace=client.namespace, timeout=client.config.timeout_s)  # fmt: skip
