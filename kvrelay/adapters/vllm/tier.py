"""The connector's side of kvrelay's cache tier: synchronous calls for vLLM's hooks.

vLLM calls its connector synchronously from the scheduler and the model
runner; kvrelay's clients are asyncio. A `TierLoop` runs one event loop on a
daemon thread and bounds every call by the configured timeout, so a dead,
stopped or refusing cache server costs at most that long and answers as a
miss or a page not written.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import torch

from kvrelay.adapters.vllm.config import ConnectorConfig
from kvrelay.cache.client import CacheClient, CacheClientConfig
from kvrelay.layout import ModelKVSpec, Rectangle
from kvrelay.transfer import create_agent

T = TypeVar("T")


class TierLoop:
    """An asyncio loop on a daemon thread; `run(coro)` waits for it, with a bound."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"kvrelay tier call took over {timeout_s} s") from None

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future:
        """Starts the coroutine on the loop without waiting (it bounds itself)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


class RankTier:
    """One vLLM rank's rectangle on the tier: probes, staged reads and writes.

    Page rows of the staging arenas are whole unified pages; this rank pulls
    and pushes only its rectangle's runs of them.
    """

    def __init__(self, config: ConnectorConfig, spec: ModelKVSpec, rect: Rectangle) -> None:
        self.config, self.spec, self.rect = config, spec, rect
        self.agent = None
        self.client: CacheClient | None = None
        self._rows: dict[str, tuple[Any, torch.Tensor]] = {}
        self.errors = 0

    async def start(self, staging: bool) -> RankTier:
        c = self.config
        # The agent serves a prefill's blocks to decodes on other hosts too.
        host = c.handoff_host if c.handoff_port else "127.0.0.1"
        self.agent = await create_agent(c.backend, token=c.token, host=host)
        if not c.servers:  # an engine that only hands blocks off
            return self
        client_config = CacheClientConfig(servers=c.servers, token=c.token, timeout_s=c.timeout_s)
        self.client = CacheClient(self.agent, self.spec, self.rect, client_config)
        if staging:
            for name in ("read", "write"):
                arena = self.agent.allocate_arena(c.staging_pages * self.spec.page_bytes)
                self._rows[name] = (arena, arena.tensor.view(c.staging_pages, -1))
        return self

    async def close(self) -> None:
        try:
            if self.client is not None:
                await self.client.close()
        finally:
            if self.agent is not None:
                await self.agent.close()

    async def count_prefix(self, keys: Sequence[bytes]) -> int:
        """Sealed pages from the first key on (a page counts once every rectangle is in)."""
        return await self.client.count_prefix(keys) if keys else 0

    async def read(
        self, keys: Sequence[bytes], consume: Callable[[torch.Tensor, int, int], None]
    ) -> int:
        """Longest cached prefix of `keys`, chunk by chunk; `consume(rows, start, n)`."""
        arena, rows = self._rows["read"]
        total = 0
        for start in range(0, len(keys), len(rows)):
            chunk = keys[start : start + len(rows)]
            found = await self.client.lookup(
                chunk, arena, [i * self.spec.page_bytes for i in range(len(chunk))]
            )
            if found:
                consume(rows, start, found)
            total += found
            if found < len(chunk):
                break
        return total

    async def write(
        self, keys: Sequence[bytes], produce: Callable[[torch.Tensor, int, int], None]
    ) -> int:
        """Write each page's rectangle; `produce(rows, start, n)` fills a chunk. Pages written."""
        if not self.rect.writer or not keys:
            return 0
        arena, rows = self._rows["write"]
        written = 0
        for start in range(0, len(keys), len(rows)):
            chunk = keys[start : start + len(rows)]
            produce(rows, start, len(chunk))
            written += await self.client.write(
                chunk, arena, [i * self.spec.page_bytes for i in range(len(chunk))]
            )
        return written
