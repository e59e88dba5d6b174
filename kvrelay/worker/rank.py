"""What a worker adds to each rank process: a transfer agent on an asyncio loop
in a background thread, a staging arena of unified page rows, and a cache
client of the rank's own rectangle.

The rank's main thread runs the engine and the gloo collectives; coroutines
of the agent and the cache client are handed to the loop thread and awaited
with a deadline (`RankRuntime.run`). The agent's lease table is touched only
on the loop thread.
"""

from __future__ import annotations

import asyncio
import enum
import threading
from dataclasses import dataclass

from kvrelay.cache.client import CacheClient, CacheClientConfig
from kvrelay.layout import rank_rectangle
from kvrelay.worker.rank_ops import ClearCache, Counters, RankCounters, RankService

# Staging rows a tier pull goes through at a time (prefill's and decode's):
# the prefix a tier serves is imported chunk by chunk, so it needs no
# staging of its own size.
TIER_WINDOW = 64


class Staging(enum.StrEnum):
    """Where a GPU pool's staging arena lives."""

    # Page-locked host memory (any backend, the memfd fast path included).
    PINNED = "pinned"
    # GPU memory next to the pool (UCX moves it: cuda_ipc on one host,
    # GPUDirect RDMA across hosts).
    DEVICE = "device"


@dataclass(frozen=True, slots=True)
class RankOptions:
    """What every rank of a worker needs besides its engine (picklable: it
    travels to spawned ranks)."""

    token: str
    backend: str
    cache: tuple[str, ...]
    staging_pages: int
    staging: Staging
    transfer_timeout_s: float
    local_cache: bool
    write_back: bool
    # Where the rank's transfer agent listens: the worker's listen host, so
    # that peers on other hosts reach the address its handles carry.
    agent_host: str = "127.0.0.1"


class PullFailed(RuntimeError):
    """A page pull from prefill (or the tier's handles) failed on some rank;
    every rank raises it, so the group stays in step."""


class StagingRows:
    """Free list of the staging arena's rows (one unified page each)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._free = list(range(count - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"{n} staging rows asked, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def give_back(self, rows: list[int]) -> None:
        self._free.extend(reversed(rows))


class RankRuntime:
    def __init__(self, engine, options: RankOptions) -> None:
        self.engine = engine
        self.options = options
        self.spec = engine.spec
        self.page_bytes = self.spec.page_bytes
        self.namespace = self.spec.namespace()
        self.rect = rank_rectangle(self.spec, engine.parallel)
        self.runs = self.rect.byte_runs(self.spec)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        from kvrelay.transfer import create_agent

        self.agent = self.run(
            create_agent(
                options.backend,
                token=options.token,
                host=options.agent_host,
                timeout=options.transfer_timeout_s,
            )
        )
        self.arena = self._staging_arena(options.staging_pages * self.page_bytes)
        self.staging = self.arena.tensor.view(options.staging_pages, self.page_bytes)
        self.rows = StagingRows(options.staging_pages)
        self.cache = None
        if options.cache:
            config = CacheClientConfig(options.cache, options.token)
            self.cache = CacheClient(self.agent, self.spec, self.rect, config)

    def _staging_arena(self, size: int):
        """Host shared memory (the fast path's memfd) beside a CPU pool or with
        `staging="pinned"`; GPU memory on the pool's GPU, registered with UCX,
        with `staging="device"`."""
        device = self.engine.pool.device
        if device.type == "cuda" and self.options.staging == Staging.DEVICE:
            import torch

            return self.agent.register_tensor(torch.zeros(size, dtype=torch.uint8, device=device))
        return self.agent.allocate_arena(size)

    def run(self, coro, timeout: float | None = None):
        """Runs a coroutine on the agent's loop; waits at most `timeout`
        (default: a few transfer timeouts, every remote call has its own)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        limit = timeout if timeout is not None else 4 * self.options.transfer_timeout_s + 5
        return future.result(limit)

    def agree(self, value: int) -> int:
        """The minimum of `value` over every rank of the worker."""
        return self.engine.comm.min_all(int(value))

    def offsets(self, rows: list[int]) -> list[int]:
        return [row * self.page_bytes for row in rows]

    def page_runs(self, rows: list[int]) -> list[tuple[int, int]]:
        """The rank's rectangle runs of each row, in row order (a handle's runs)."""
        return [(row * self.page_bytes + off, n) for row in rows for off, n in self.runs]

    def tier_lookup(self, keys: list[bytes], rows: list[int]) -> int:
        """Pull the tier's longest prefix of `keys` into `rows`; ranks agree on
        the minimum. A rank without the tier (or with nothing to ask) hits 0."""
        hit = 0
        if self.cache is not None and keys:
            hit = self.run(self.cache.lookup(keys, self.arena, self.offsets(rows)))
        return self.agree(hit)

    def tier_write(self, keys: list[bytes], rows: list[int]) -> bool:
        """Write full pages through to the tier; True when every rank wrote
        without a server error (ranks agree)."""
        ok = True
        if self.cache is not None and keys:
            errors = self.cache.stats.errors
            self.run(self.cache.write(keys, self.arena, self.offsets(rows)))
            ok = self.cache.stats.errors == errors
        return bool(self.agree(int(ok)))

    def counters(self, **role) -> RankCounters:
        stats = self.cache.stats if self.cache is not None else None
        return RankCounters(
            bytes_from_tier=stats.bytes_in if stats else 0,
            bytes_to_tier=stats.bytes_out if stats else 0,
            free_pages=self.engine.pool.free_pages,
            staging_free=self.rows.free,
            **role,
        )

    def clear_cache(self, _: ClearCache | None = None) -> None:
        self.engine.pool.clear_cache()

    def close(self) -> None:
        async def shutdown():
            if self.cache is not None:
                await self.cache.close()
            await self.agent.close()

        try:
            self.run(shutdown(), timeout=10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)


class RoleRanks(RankService):
    """A role's commands in one rank, over the rank's `RankRuntime` and its
    draft pages (`DraftPages`); every role answers `Counters` and `ClearCache`."""

    def __init__(self, engine, options: RankOptions, handlers: dict) -> None:
        from kvrelay.worker.draft_pages import DraftPages  # it imports this module

        self.rt = RankRuntime(engine, options)
        self.draft = DraftPages(self.rt)
        self.engine = engine
        self.ps = engine.spec.page_size
        super().__init__({Counters: self.counters, ClearCache: self.rt.clear_cache, **handlers})

    def counters(self, _: Counters) -> RankCounters:
        return self.rt.counters()

    def close(self) -> None:
        try:
            self.rt.run(self.draft.close(), timeout=10)
        finally:
            self.rt.close()
