"""Unified pages filled from several SGLang host pools (async, on the adapter's loop).

An MLA page with DSA indexer keys takes its latent rows from SGLang's KV host
pool and its indexer keys from the indexer host pool, which SGLang moves in
separate calls (the indexer's first, then the KV's). Each pool is a *part* of
the page: per layer one byte run (`ModelKVSpec.layer_offset`), moved by a
cache client of its own that writes and reads only those runs. The cache
server seals a page once every run of it is in, whichever call brought it,
and only sealed pages are found: a page whose indexer keys never arrived is
a miss for both pools. Draft pages packed into the target's host pools
(SGLang's MTP layers as tail layers) are parts of draft pages the same way.

Parts move through staging rows of whole pages: a part fills only its runs.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import torch

from kvrelay.adapters.sglang.identity import rope_to_pairs, rope_to_unified
from kvrelay.cache.client import CacheClient, CacheClientConfig
from kvrelay.layout import ModelKVSpec, Rectangle
from kvrelay.transfer import create_agent

CALLS_PER_BATCH = 3


def mla_page_view(pool) -> torch.Tensor:
    """An MLA host pool's buffer as [page, layer, token, width]."""
    buf, ps, layers = pool.kv_buffer, int(pool.page_size), int(pool.layer_num)
    if pool.layout == "layer_first":  # [layer, slot, 1, width]
        return buf.view(layers, -1, ps, buf.size(-1)).permute(1, 0, 2, 3)
    if pool.layout == "page_first":  # [slot, layer, 1, width]
        return buf.view(-1, ps, layers, buf.size(-1)).permute(0, 2, 1, 3)
    if pool.layout in ("page_first_direct", "page_unified"):
        return buf.view(buf.size(0), layers, ps, -1)
    raise ValueError(f"MLA host layout {pool.layout!r} is not supported")


def index_page_view(pool) -> torch.Tensor:
    """A DSA indexer host pool's buffer as [page, layer, page record bytes]."""
    buf = pool.index_k_with_scale_buffer
    if pool.layout == "layer_first":  # [layer, page, stride]
        return buf.permute(1, 0, 2)
    if pool.layout in ("page_first", "page_first_direct"):  # [page, layer, 1, stride]
        return buf.view(buf.size(0), buf.size(1), -1)
    raise ValueError(f"DSA indexer host layout {pool.layout!r} is not supported")


@dataclass
class Part:
    """Host layers of one pool, each the byte run at `offsets[i]` of a page."""

    view: torch.Tensor  # [page, host layer, ...] of the pool
    host_layers: list[int]
    offsets: list[int]
    block_bytes: int
    page_size: int
    rope: int = 0  # latent rows whose RoPE part SGLang holds as pairs (`rope_order`)

    @property
    def runs(self) -> list[tuple[int, int]]:
        runs: list[tuple[int, int]] = []
        for offset in sorted(self.offsets):
            if runs and runs[-1][0] + runs[-1][1] == offset:
                runs[-1] = (runs[-1][0], runs[-1][1] + self.block_bytes)
            else:
                runs.append((offset, self.block_bytes))
        return runs

    def pages(self, host_indices: torch.Tensor, count: int) -> torch.Tensor:
        slots = host_indices.to(torch.int64).reshape(-1)
        if slots.numel() != count * self.page_size:
            raise ValueError(f"{slots.numel()} host indices for {count} pages")
        firsts = slots[:: self.page_size]
        if bool((firsts % self.page_size).any()):
            raise ValueError("host indices of a page must start on a page boundary")
        return firsts // self.page_size

    def gather(self, host_indices: torch.Tensor, rows: torch.Tensor, n: int) -> None:
        """Host pages -> this part's runs of `rows[:n]` (uint8 whole pages)."""
        pages = self.pages(host_indices, n)
        for layer, offset in zip(self.host_layers, self.offsets, strict=True):
            block = self.view[:, layer].index_select(0, pages)
            if self.rope:
                rope_to_unified(block, self.rope)
            rows[:n, offset : offset + self.block_bytes].copy_(
                block.reshape(n, -1).view(torch.uint8)
            )

    def scatter(self, rows: torch.Tensor, host_indices: torch.Tensor, n: int) -> None:
        """This part's runs of `rows[:n]` -> host pages."""
        pages = self.pages(host_indices, n)
        for layer, offset in zip(self.host_layers, self.offsets, strict=True):
            dest = self.view[:, layer]
            block = rows[:n, offset : offset + self.block_bytes].clone()
            block = block.view(dest.dtype).view(n, *dest.shape[1:])
            if self.rope:
                rope_to_pairs(block, self.rope)
            dest.index_copy_(0, pages, block)


def latent_part(spec: ModelKVSpec, pool, host_layers, layers, rope: int = 0) -> Part:
    """Host layers `host_layers` of an MLA pool as the latent rows of `layers`
    (`rope`: the width of a RoPE part the pool holds as interleaved pairs)."""
    view = mla_page_view(pool)
    return Part(view, list(host_layers), [spec.layer_offset(layer) for layer in layers],
                spec.page_size * spec.k_row_bytes, spec.page_size, rope)  # fmt: skip


def index_part(spec: ModelKVSpec, pool, host_layers, layers) -> Part:
    """Host layers of a DSA indexer pool as the indexer keys of `layers`."""
    latent = spec.page_size * spec.k_row_bytes
    offsets = [spec.layer_offset(layer) + latent for layer in layers]
    return Part(index_page_view(pool), list(host_layers), offsets,
                spec.page_size * spec.index_row_bytes, spec.page_size)  # fmt: skip


class RunsClient(CacheClient):
    """A cache client that moves given byte runs of each page (one pool's part)."""

    def __init__(self, agent, spec, runs, config, writer: bool, slot_bytes=None) -> None:
        rect = Rectangle(0, 1, 0, spec.num_layers, writer)
        super().__init__(agent, spec, rect, config, slot_bytes)
        tail = self._commit_runs[len(self.runs) :]  # a draft page's unused slot tail
        self.runs = list(runs)
        self._commit_runs = self.runs + tail


class PageTier:
    """One rank's parts of pages of `spec` on the cache tier (in slots of
    `slot_bytes`: draft pages fill the start of a target page's slot)."""

    def __init__(
        self, config, spec: ModelKVSpec, parts: dict[str, Part], writer: bool, slot_bytes=None
    ) -> None:
        self.config, self.spec, self.parts, self.writer = config, spec, parts, writer
        self.slot_bytes = slot_bytes
        self.rows = config.staging_rows(spec.page_bytes)
        self.agent = None
        self.clients: dict[str, RunsClient] = {}
        self._staging: dict[str, tuple[object, torch.Tensor, asyncio.Lock]] = {}
        self.errors = 0

    async def start(self) -> PageTier:
        c = self.config
        self.agent = await create_agent(c.backend, token=c.token)
        client_config = CacheClientConfig(
            servers=c.servers, token=c.token, timeout_s=c.timeout_s / CALLS_PER_BATCH
        )
        for name, part in self.parts.items():
            self.clients[name] = RunsClient(
                self.agent, self.spec, part.runs, client_config, self.writer, self.slot_bytes
            )
        for name in ("read", "write"):
            arena = self.agent.allocate_arena(self.rows * self.spec.page_bytes)
            rows = arena.tensor.view(self.rows, self.spec.page_bytes)
            self._staging[name] = (arena, rows, asyncio.Lock())
        return self

    async def close(self) -> None:
        try:
            for client in self.clients.values():
                with contextlib.suppress(Exception):
                    await client.close()
        finally:
            if self.agent is not None:
                await self.agent.close()

    def _client_errors(self) -> int:
        return sum(client.stats.errors for client in self.clients.values())

    async def exists(self, keys: list[bytes]) -> int:
        """The sealed prefix of `keys`: pages with every part in."""
        if not keys:
            return 0
        before = self._client_errors()
        found = await next(iter(self.clients.values())).count_prefix(keys)
        self.errors += self._client_errors() - before
        return found

    async def read(self, name: str, keys: list[bytes], host_indices: torch.Tensor) -> int:
        """Bring part `name` of the longest sealed prefix of `keys` into its pool."""
        part, client = self.parts[name], self.clients[name]
        arena, rows, lock = self._staging["read"]
        total, before = 0, self._client_errors()
        async with lock:
            for start in range(0, len(keys), self.rows):
                chunk = keys[start : start + self.rows]
                bases = [i * self.spec.page_bytes for i in range(len(chunk))]
                found = await client.lookup(chunk, arena, bases)
                if found:
                    ps = part.page_size
                    part.scatter(rows, host_indices[start * ps : (start + found) * ps], found)
                total += found
                if found < len(chunk):
                    break
        self.errors += self._client_errors() - before
        return total

    async def write(self, name: str, keys: list[bytes], host_indices: torch.Tensor) -> bool:
        """Write part `name` of each page; True when no server call failed."""
        if not self.writer or not keys:
            return True
        part, client = self.parts[name], self.clients[name]
        arena, rows, lock = self._staging["write"]
        before = self._client_errors()
        async with lock:
            for start in range(0, len(keys), self.rows):
                chunk = keys[start : start + self.rows]
                ps = part.page_size
                part.gather(host_indices[start * ps : (start + len(chunk)) * ps], rows, len(chunk))
                bases = [i * self.spec.page_bytes for i in range(len(chunk))]
                await client.write(chunk, arena, bases)
        failed = self._client_errors() - before
        self.errors += failed
        return not failed

    async def clear(self) -> None:
        await next(iter(self.clients.values())).admin_flush(self.spec.namespace())
