"""One SGLang rank's rectangle on kvrelay's cache tier (async, on the adapter's loop).

Pages move with `CacheClient`s of the rank's rectangle: straight into and out
of the registered host pool when its bytes are unified pages (`PoolMover.zero_copy`),
else by the compiled ops between the pool and a same-host server's slots
(`pool_pages`), else through staging arenas of compact rectangles that
`PoolMover` fills and empties. A client moves a page's rectangle runs to `page_offsets[i] + run
offset`; local memory holds compact rectangles, so each page offset is shifted
back by where the rectangle's runs sit in a full page. A rectangle that spans
every layer is one run per page; one that does not (a PP stage) gets a client
per head, each a single run.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvrelay import aio
from kvrelay.adapters.sglang.config import AdapterConfig
from kvrelay.adapters.sglang.pool_io import PoolMover
from kvrelay.adapters.sglang.pool_pages import PoolChunk, PoolPages, SlotGeometry
from kvrelay.adapters.sglang.read_ahead import ReadAhead
from kvrelay.cache.client import CacheClient, CacheClientConfig
from kvrelay.cache.direct_lane import DirectLane, LaneShare
from kvrelay.layout import ModelKVSpec, Rectangle
from kvrelay.transfer import create_agent

# A server call's share of an adapter call's time bound (lookup, handle, transfer).
CALLS_PER_BATCH = 3


@dataclass(slots=True)
class AdapterStats:
    get_pages: int = 0  # pages asked for by batch_get_v1 / batch_get / get
    hit_pages: int = 0  # of those, read from the tier
    miss_pages: int = 0
    set_pages: int = 0  # pages offered by batch_set_v1 / batch_set / set
    set_failed_pages: int = 0
    bytes_read: int = 0  # rectangle bytes brought into the host pool
    bytes_written: int = 0  # rectangle bytes pushed to the tier
    exists_calls: int = 0
    read_ahead_pages: int = 0  # of hit_pages, pulled by the lookup (batch_exists) before
    direct_pages: int = 0  # pages copied straight between the pool and a same-host server's slots
    caller_calls: int = 0  # get / set calls made on SGLang's thread (`DirectLane`)
    board_reads: int = 0  # of those, gets that asked no server (off their slot boards)
    errors: int = 0  # server calls answered as misses or failed writes
    timeouts: int = 0  # adapter calls cut at their time bound


def client_groups(spec: ModelKVSpec, rect: Rectangle) -> list[tuple[Rectangle, int]]:
    """(rectangle, shift) per client: local page offset = compact page start - shift."""
    block = spec.block_bytes
    if rect.num_layers == spec.num_layers:
        return [(rect, rect.head_start * spec.num_layers * block)]
    groups = []
    for j in range(rect.num_heads):
        head = rect.head_start + j
        part = Rectangle(head, head + 1, rect.layer_start, rect.layer_end, rect.writer)
        full = (head * spec.num_layers + rect.layer_start) * block
        groups.append((part, full - j * rect.num_layers * block))
    return groups


class RankTier:
    def __init__(
        self,
        config: AdapterConfig,
        spec: ModelKVSpec,
        rect: Rectangle,
        mover: PoolMover,
        slot_bytes: int | None = None,  # draft pages: the target page's slot
    ) -> None:
        self.config, self.spec, self.rect, self.mover = config, spec, rect, mover
        self.slot_bytes = slot_bytes
        self.rect_bytes = rect.num_bytes(spec)
        self.stats = AdapterStats()
        self.agent = None
        self.clients: list[tuple[CacheClient, int]] = []
        self._pool_arena = None
        self._staging: dict[str, tuple[object, torch.Tensor, asyncio.Lock]] = {}
        self.ahead: ReadAhead | None = None
        self._ahead_lock = asyncio.Lock()  # one lookup at a time fills the read-ahead
        # The read-ahead's rows and map are shared with `take_ahead`, which
        # runs on SGLang's thread: a row is handed to a new lookup only
        # while no copy out of it runs.
        self._ahead_rows = threading.Lock()
        self._lanes: dict[str, list[DirectLane]] | None = None

    async def start(self) -> RankTier:
        c = self.config
        self.agent = await create_agent(c.backend, token=c.token)
        client_config = CacheClientConfig(
            servers=c.servers, token=c.token, timeout_s=c.timeout_s / CALLS_PER_BATCH
        )
        self.clients = [
            (CacheClient(self.agent, self.spec, part, client_config, self.slot_bytes), shift)
            for part, shift in client_groups(self.spec, self.rect)
        ]
        slot_bytes = self.slot_bytes or self.spec.page_bytes
        self._slots = [
            SlotGeometry.of(self.mover, self.spec, client.rect,
                            client.rect.head_start - self.rect.head_start, slot_bytes)
            for client, _ in self.clients
        ]  # fmt: skip
        if self.mover.zero_copy:
            self._pool_arena = self.agent.register_tensor(self.mover.pool.kv_buffer)
        elif all(slot is not None for slot in self._slots):
            # Reads and writes on SGLang's threads (its prefetch and backup
            # threads each a lane of their own, so neither waits on the other);
            # a client's two lanes share the servers' slot boards and the
            # commits the write lane posted.
            shares = [LaneShare() for _ in self.clients]
            self._lanes = {
                name: [DirectLane(c, share)
                       for (c, _), share in zip(self.clients, shares, strict=True)]
                for name in ("read", "write")
            }  # fmt: skip
        staging_rows = c.staging_rows(self.rect_bytes)
        for name in ("read", "write"):
            arena = self.agent.allocate_arena(staging_rows * self.rect_bytes)
            rows = arena.tensor.view(staging_rows, self.rect_bytes)
            self._staging[name] = (arena, rows, asyncio.Lock())
        if not self.mover.zero_copy:  # a zero-copy pool takes pages straight in
            ahead_rows = 2 * staging_rows  # a prefetch's lookups, two batches deep
            arena = self.agent.allocate_arena(ahead_rows * self.rect_bytes)
            self.ahead = ReadAhead(arena, self.rect_bytes, ahead_rows)
        return self

    async def close(self) -> None:
        """Close every client, then the agent, even when one of them fails."""
        try:
            for lane in [lane for lanes in (self._lanes or {}).values() for lane in lanes]:
                lane.close()
            for client, _ in self.clients:
                with contextlib.suppress(Exception):
                    await client.close()
        finally:
            if self.agent is not None:
                await self.agent.close()

    def _errors(self) -> int:
        return sum(client.stats.errors for client, _ in self.clients)

    def settle(self) -> None:
        """The commits the write lanes posted, answered: what this rank wrote
        is sealed before the loop reads or flushes (`LaneShare.settle`)."""
        for lane in (self._lanes or {}).get("write", ()):
            lane.share.settle()

    # -- lookups ----------------------------------------------------------------
    async def exists(self, keys: Sequence[bytes]) -> int:
        """Sealed prefix: a page counts once every rectangle of it is in. With a
        read-ahead arena the prefix's rectangles are pulled into it as well."""
        self.settle()
        self.stats.exists_calls += 1
        before = self._errors()
        if self.ahead is None or len(keys) > self.ahead.capacity:
            prefix = await self.clients[0][0].count_prefix(keys)
        else:
            async with self._ahead_lock:
                with self._ahead_rows:
                    start = self.ahead.block(len(keys))
                bases = self.ahead.bases(start, len(keys))
                prefix = await self._lookup(keys, self.ahead.arena, bases)
                with self._ahead_rows:
                    self.ahead.hold(keys[:prefix], start)
        self.stats.errors += self._errors() - before
        return prefix

    async def _lookup(self, keys, arena, bases: list[int] | None) -> int:
        """Every client's prefix pulled into `arena` at `bases`, or a `PoolChunk`."""
        found = await aio.gather(
            *(
                client.lookup(keys, *self._local(arena, bases, i))
                for i, (client, _) in enumerate(self.clients)
            )
        )
        return min(found)

    def _local(self, arena, bases, i: int) -> tuple:
        """Client i's (destination, page offsets) for a lookup or write."""
        shift = self.clients[i][1]
        if isinstance(arena, PoolChunk):
            return PoolPages(arena, shift, self._slots[i]), None
        return arena, [b - shift for b in bases]

    def take_ahead(self, keys: Sequence[bytes], host_indices: torch.Tensor) -> int:
        """Copy the longest prefix of `keys` that the read-ahead holds into the
        host pool, on the calling thread (no hop to the loop); return its length."""
        if self.ahead is None or not keys or not len(self.ahead):
            return 0  # nothing held: no lock, no tensor slicing (every cold get)
        page = self.mover.page_size
        with self._ahead_rows:  # no lookup takes these rows during the copy
            held = self.ahead.prefix(keys)
            ahead = len(held)
            if ahead:
                self.mover.scatter(held, host_indices[: ahead * page], ahead)
                self.stats.read_ahead_pages += ahead
                self.stats.bytes_read += ahead * self.rect_bytes
        return ahead

    # -- calls on SGLang's thread --------------------------------------------------------
    def read_on_caller(self, keys: Sequence[bytes], host_indices: torch.Tensor) -> int | None:
        """`read_pool` made on the calling thread by the rank's `DirectLane`s;
        None where it must go by the loop (`read_pool` then makes it whole)."""
        if self._lanes is None:
            return None
        chunk = self._lane_chunk(host_indices, "read")
        found, lanes = len(keys), self._lanes["read"]
        boarded = sum(lane.board_reads for lane in lanes)
        for lane, slot, (_, shift) in zip(lanes, self._slots, self.clients, strict=True):
            got = lane.read(keys, PoolPages(chunk, shift, slot))
            if got is None:
                return None
            found = min(found, got)
        self.stats.caller_calls += 1
        self.stats.board_reads += sum(lane.board_reads for lane in lanes) - boarded == len(lanes)
        self.stats.direct_pages += len([p for p in chunk.direct if p < found])
        self.stats.bytes_read += found * self.rect_bytes
        return found

    def write_on_caller(self, keys: Sequence[bytes], host_indices: torch.Tensor) -> bool | None:
        """`write_pool` made on the calling thread; None where it must go by the loop."""
        if self._lanes is None or not self.rect.writer:
            return None
        chunk = self._lane_chunk(host_indices, "write")
        for lane, slot, (_, shift) in zip(
            self._lanes["write"], self._slots, self.clients, strict=True
        ):
            if lane.write(keys, PoolPages(chunk, shift, slot)) is None:
                return None
        self.stats.caller_calls += 1
        self.stats.direct_pages += len(chunk.direct)
        self.stats.bytes_written += len(keys) * self.rect_bytes
        return True

    def _lane_chunk(self, host_indices: torch.Tensor, name: str) -> PoolChunk:
        """The call's pages as a `PoolChunk` (its staging rows unused: a lane copies straight)."""
        arena, rows, _ = self._staging[name]
        return PoolChunk(self.mover, host_indices, arena, rows)

    async def read_pool(self, keys: Sequence[bytes], host_indices: torch.Tensor) -> int:
        """Bring the longest cached prefix of `keys` into the host pool; return its length."""
        self.settle()
        if self.mover.zero_copy:
            pages = self.mover.page_numbers(host_indices, len(keys))
            return await self._count_read(
                keys, self._pool_arena, self.mover.zero_copy_offsets(pages)
            )
        page = self.mover.page_size
        ahead = self.take_ahead(keys, host_indices)
        if ahead == len(keys):
            return ahead
        arena, rows, lock = self._staging["read"]
        total = 0
        async with lock:
            for start in range(ahead, len(keys), len(rows)):
                chunk_keys = keys[start : start + len(rows)]
                indices = host_indices[start * page : (start + len(chunk_keys)) * page]
                chunk = PoolChunk(self.mover, indices, arena, rows)
                found = await self._count_read(chunk_keys, chunk)
                chunk.scatter_staged(found)
                self.stats.direct_pages += len([p for p in chunk.direct if p < found])
                total += found
                if found < len(chunk_keys):
                    break
        return ahead + total

    async def read_staged(
        self, keys: Sequence[bytes], consume: Callable[[torch.Tensor, int, int], None]
    ) -> int:
        """Read through the staging arena; `consume(rows, start, n)` takes each chunk's hits."""
        self.settle()
        arena, rows, lock = self._staging["read"]
        total = 0
        async with lock:
            for start in range(0, len(keys), len(rows)):
                chunk = keys[start : start + len(rows)]
                bases = [i * self.rect_bytes for i in range(len(chunk))]
                found = await self._count_read(chunk, arena, bases)
                if found:
                    consume(rows, start, found)
                total += found
                if found < len(chunk):
                    break
        return total

    async def _count_read(self, keys, arena, bases: list[int] | None = None) -> int:
        """Pull the prefix into `arena` at `bases` (or a `PoolChunk`); return its length."""
        before = self._errors()
        found = await self._lookup(keys, arena, bases)
        self.stats.errors += self._errors() - before
        self.stats.bytes_read += found * self.rect_bytes
        return found

    # -- writes -------------------------------------------------------------------
    async def write_pool(self, keys: Sequence[bytes], host_indices: torch.Tensor) -> bool:
        """Write the rank's rectangle of each page; True when no server call failed."""
        if not self.rect.writer or not keys:
            return True  # a replica: the rank that writes these heads does it
        if self.mover.zero_copy:
            pages = self.mover.page_numbers(host_indices, len(keys))
            return await self._push(keys, self._pool_arena, self.mover.zero_copy_offsets(pages))
        page = self.mover.page_size
        arena, rows, lock = self._staging["write"]
        ok = True
        async with lock:
            for start in range(0, len(keys), len(rows)):
                chunk_keys = keys[start : start + len(rows)]
                indices = host_indices[start * page : (start + len(chunk_keys)) * page]
                chunk = PoolChunk(self.mover, indices, arena, rows)
                ok = await self._push(chunk_keys, chunk) and ok
                self.stats.direct_pages += len(chunk.direct)
        return ok

    async def write_staged(
        self, keys: Sequence[bytes], produce: Callable[[torch.Tensor, int, int], None]
    ) -> bool:
        """Write through the staging arena; `produce(rows, start, n)` fills each chunk."""
        if not self.rect.writer:
            return True
        arena, rows, lock = self._staging["write"]
        ok = True
        async with lock:
            for start in range(0, len(keys), len(rows)):
                chunk = keys[start : start + len(rows)]
                produce(rows, start, len(chunk))
                bases = [i * self.rect_bytes for i in range(len(chunk))]
                ok = await self._push(chunk, arena, bases) and ok
        return ok

    async def _push(self, keys, arena, bases: list[int] | None = None) -> bool:
        """Write from `arena` at `bases` (or a `PoolChunk`); True when no call failed."""
        before = self._errors()
        await aio.gather(
            *(
                client.write(keys, *self._local(arena, bases, i))
                for i, (client, _) in enumerate(self.clients)
            )
        )
        failed = self._errors() - before
        self.stats.errors += failed
        if not failed:
            self.stats.bytes_written += len(keys) * self.rect_bytes
        return not failed

    async def clear(self) -> None:
        """Drop this model namespace's pages from every server (and from the read-ahead)."""
        self.settle()  # a commit answered after the flush would seal its pages again
        if self.ahead is not None:
            with self._ahead_rows:
                self.ahead.forget()
        await self.clients[0][0].admin_flush(self.spec.namespace())
