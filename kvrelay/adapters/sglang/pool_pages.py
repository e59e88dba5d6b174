"""SGLang host pages as a cache client's `PageMover`: one copy between pool and slots.

A chunk of host pages (`PoolChunk`) moves through each client of the rank's
rectangle (`PoolPages`, one per client). Where the cache server is a
same-host agent whose arena the transfer agent can map
(`Agent.copy_mapped`), the compiled gather / scatter ops treat that arena as
their page rows, slot numbers as row ids: a page goes from the host pool
into its slot (or back) in one copy, as a store whose segment sits in the
engine's own process (Mooncake's default) moves it. Elsewhere (another host,
a pool layout the ops do not read, pages smaller than their slots) the chunk
goes through the rank's staging rows, filled or emptied once for every
client, and the transfer agent moves those: two copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvrelay.adapters.sglang.pool_io import TOKEN_LAYOUTS, PoolMover
from kvrelay.cache.client import CacheClient
from kvrelay.cache.direct_lane import handle_slots
from kvrelay.cache.page_movers import ArenaPages
from kvrelay.cuda_ext import gather_pages, scatter_pages
from kvrelay.layout import ModelKVSpec, Rectangle
from kvrelay.transfer import Arena, BlockHandle


@dataclass(frozen=True, slots=True)
class SlotGeometry:
    """Where one client's rectangle sits in a slot of a cache server's arena,
    in the compiled ops' terms (`gather_pages` with whole slots as pages)."""

    slot_bytes: int
    op_args: dict[str, int]  # the ops' page geometry: heads and layers of a slot, the part's

    @classmethod
    def of(
        cls, mover: PoolMover, spec: ModelKVSpec, part: Rectangle, pool_head: int, slot_bytes: int
    ) -> SlotGeometry | None:
        """None where the ops cannot write the part straight into slots."""
        g = mover.geometry
        if (
            mover.rope
            or g.layout not in TOKEN_LAYOUTS
            or not spec.uniform
            or slot_bytes != spec.page_bytes
            or spec.page_bytes != spec.num_kv_heads * spec.num_layers * spec.block_bytes
            or part.num_layers != g.local_layers
        ):
            return None
        op_args = {
            "page_heads": spec.num_kv_heads,
            "page_layers": spec.num_layers,
            "page_head_start": part.head_start,
            "page_layer_start": part.layer_start,
            "pool_head_start": pool_head,
            "num_heads": part.num_heads,
        }
        return cls(slot_bytes, op_args)


class PoolChunk:
    """Up to a staging arena's worth of host pages of one call (`host_indices`:
    page_size token slots per page), shared by the rank's clients."""

    def __init__(
        self, mover: PoolMover, host_indices: torch.Tensor, staging: Arena, rows: torch.Tensor
    ) -> None:
        self.mover, self.staging, self.rows = mover, staging, rows
        self.page = mover.page_size
        self.slots = host_indices.to(torch.int64).reshape(-1, self.page).contiguous()
        self.gathered = False  # rows hold the chunk's pages (writes through staging)
        self.staged: set[int] = set()  # positions read into rows, not yet in the pool
        self.direct: set[int] = set()  # positions copied straight between pool and slots

    def token_slots(self, rows: list[int]) -> torch.Tensor:
        """[len(rows), page_size] pool slots of the chunk's pages `rows`."""
        first = rows[0] if rows else 0
        if rows == list(range(first, first + len(rows))):
            return self.slots[first : first + len(rows)]  # rows of a contiguous tensor
        return self.slots[rows]

    def gather_rows(self) -> None:
        if not self.gathered:
            n = len(self.slots)
            self.mover.gather(self.slots.reshape(-1), self.rows, n)
            self.gathered = True

    def scatter_staged(self, found: int) -> None:
        """Staged reads of the first `found` pages -> the host pool, run by run."""
        positions = sorted(p for p in self.staged if p < found)
        self.staged.clear()
        start = 0
        while start < len(positions):
            end = start
            while end + 1 < len(positions) and positions[end + 1] == positions[end] + 1:
                end += 1
            a, b = positions[start], positions[end] + 1
            self.mover.scatter(self.rows[a:b], self.slots[a:b].reshape(-1), b - a)
            start = end + 1


class PoolPages:
    """One client's view of a `PoolChunk` (a `PageMover`); `shift`: where the
    client's runs start in a compact staging row, `slot`: its place in a
    server slot, None where pages cannot go straight there."""

    def __init__(
        self, chunk: PoolChunk, shift: int, slot: SlotGeometry | None, start: int = 0
    ) -> None:
        self.chunk, self.shift, self.slot, self.start = chunk, shift, slot, start

    def shifted(self, start: int) -> PoolPages:
        return PoolPages(self.chunk, self.shift, self.slot, self.start + start)

    def _rows(self, positions: Sequence[int]) -> list[int]:
        return [self.start + p for p in positions]

    def copy_slots(
        self, arena: torch.Tensor, client: CacheClient, slots, positions, *, to_slots: bool
    ) -> bool:
        """Pages `positions` between the host pool and `slots` of `arena` (a
        server's arena mapped here), in one compiled copy (a
        `direct_lane.SlotCopier`); False where they cannot go straight."""
        if self.slot is None:
            return False
        rows, geometry = self._rows(positions), self.slot
        pages = arena[: arena.numel() // geometry.slot_bytes * geometry.slot_bytes]
        pages = pages.view(-1, geometry.slot_bytes)
        slots = torch.from_numpy(np.asarray(slots, dtype=np.int64))
        k, v = self.chunk.mover.token_layers()
        op = gather_pages if to_slots else scatter_pages
        op(k, v, pages, slots, self.chunk.token_slots(rows), **geometry.op_args)
        self.chunk.direct.update(rows)
        return True

    async def _direct(self, client: CacheClient, handle, positions, gather: bool) -> bool:
        if self.slot is None:
            return False
        return await client.agent.copy_mapped(
            handle,
            lambda arena: self.copy_slots(
                arena, client, handle_slots(handle, client), positions, to_slots=gather
            ),
            namespace=client.namespace,
            timeout=client.config.timeout_s,
        )

    def _staged(self) -> ArenaPages:
        """The chunk's staging rows from this view's start, as the agent moves them."""
        width = self.chunk.mover.rect_bytes
        rows = range(self.start, len(self.chunk.slots))
        return ArenaPages(self.chunk.staging, [r * width - self.shift for r in rows])

    async def pull(self, client: CacheClient, handle: BlockHandle, positions) -> None:
        if not await self._direct(client, handle, positions, gather=False):
            await self._staged().pull(client, handle, positions)
            self.chunk.staged.update(self._rows(positions))

    async def push(self, client: CacheClient, handle: BlockHandle, positions) -> None:
        if not await self._direct(client, handle, positions, gather=True):
            self.chunk.gather_rows()
            await self._staged().push(client, handle, positions)
