"""`KvrelayHiCacheStorage`: SGLang's HiCache L3 storage backend on kvrelay's cache tier.

SGLang constructs it through `StorageBackendFactory` ("dynamic" backend) as
`KvrelayHiCacheStorage(storage_config, kwargs)` and hands over the host pool
with `register_mem_pool_host`. Its calls come from SGLang's prefetch and
backup threads and are synchronous; this backend runs kvrelay's asyncio
clients on one thread of its own and bounds every call by `timeout_s`: a dead
or slow cache server turns into misses (lookups) or False (writes), never an
exception out of the v1 calls and never None.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kvrelay.adapters.sglang.config import AdapterConfig
from kvrelay.adapters.sglang.identity import (
    kvrelay_key,
    model_spec,
    pool_geometry,
    rank_rectangle,
)
from kvrelay.adapters.sglang.pool_io import PoolMover
from kvrelay.adapters.sglang.tier_io import AdapterStats, RankTier

log = logging.getLogger(__name__)

# Grace beyond the call bound for the loop thread to hand back a cancelled call.
CANCEL_GRACE_S = 1.0
CLOSE_BOUND_S = 30.0


class _LoopThread:
    """An asyncio loop on a daemon thread; `run` waits at most `timeout` seconds."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                       name="kvrelay-hicache")  # fmt: skip
        self.thread.start()

    def run(self, coro, timeout: float):
        async def bounded():
            async with asyncio.timeout(timeout):
                return await coro

        future = asyncio.run_coroutine_threadsafe(bounded(), self.loop)
        try:
            return future.result(timeout + CANCEL_GRACE_S)
        except FutureTimeout:
            future.cancel()
            raise TimeoutError(f"kvrelay call exceeded {timeout} s") from None

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        # Transports close on a later loop turn: let them before stopping.
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0.05), self.loop).result(2)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        if not self.thread.is_alive():
            self.loop.close()


class KvrelayHiCacheStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        self.storage_config = storage_config
        self.config = AdapterConfig.from_extra_config(storage_config.extra_config)
        self.tier: RankTier | None = None
        self.namespace = b""
        self._loop = _LoopThread()
        self._metrics = {"prefetch_pgs": [], "backup_pgs": []}

    # -- setup ------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Work out the model spec and the rank's rectangle, connect to the tier."""
        super().register_mem_pool_host(mem_pool_host)
        geometry = pool_geometry(mem_pool_host)
        spec = model_spec(self.config, self.storage_config, geometry)
        rect = rank_rectangle(spec, self.storage_config, geometry)
        mover = PoolMover(mem_pool_host, geometry, rect.num_bytes(spec))
        tier = RankTier(self.config, spec, rect, mover)
        self._loop.run(tier.start(), self.config.timeout_s)
        self.tier, self.spec, self.rect, self.namespace = tier, spec, rect, spec.namespace()
        log.info(
            "kvrelay HiCache backend: %s layout %s, heads [%d, %d) layers [%d, %d)%s, %s",
            spec.model_id, geometry.layout, rect.head_start, rect.head_end, rect.layer_start,
            rect.layer_end, "" if rect.writer else " (reader)",
            "zero-copy" if mover.zero_copy else "staged",
        )  # fmt: skip

    @property
    def stats(self) -> AdapterStats:
        return self.tier.stats if self.tier is not None else AdapterStats()

    def _require_pool(self) -> RankTier:
        if self.tier is None:
            raise RuntimeError("register_mem_pool_host must be called before page calls")
        return self.tier

    def _keys(self, keys: list[str]) -> list[bytes]:
        return [kvrelay_key(self.namespace, k) for k in keys]

    def _run(self, coro, fallback):
        """Run a tier call within the bound; a timeout or failure answers `fallback`."""
        try:
            return self._loop.run(coro, self.config.timeout_s)
        except TimeoutError:
            self.stats.timeouts += 1
        except Exception:  # the tier never fails SGLang's request: count and miss
            log.exception("kvrelay HiCache call failed")
            self.stats.errors += 1
        return fallback

    # -- lookups ------------------------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info=None) -> int:
        tier = self._require_pool()
        if not keys:
            return 0
        return self._run(tier.exists(self._keys(keys)), 0)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- zero-copy interface (interface_v1) -----------------------------------------------
    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info=None
    ) -> list[bool]:
        """Read each page's rectangle into the host pool; True for the cached prefix."""
        tier = self._require_pool()
        names = self._keys(keys)
        # Pages the lookup pulled are copied here, on SGLang's thread; only
        # what it did not hold goes to the loop (and the servers).
        found = self._take_ahead(tier, names, host_indices)
        if found < len(keys):
            rest = host_indices[found * tier.mover.page_size :]
            found += self._run(tier.read_pool(names[found:], rest), 0)
        self._count_get(len(keys), found)
        return [i < found for i in range(len(keys))]

    def _take_ahead(self, tier: RankTier, names: list[bytes], host_indices) -> int:
        try:
            return tier.take_ahead(names, host_indices)
        except Exception:  # never fails SGLang's request: the loop's read follows
            log.exception("kvrelay read-ahead copy failed")
            self.stats.errors += 1
            return 0

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info=None
    ) -> list[bool]:
        tier = self._require_pool()
        ok = self._run(tier.write_pool(self._keys(keys), host_indices), False) if keys else True
        self._count_set(len(keys), ok)
        return [ok] * len(keys)

    # -- plain interface: flat pages in get_data_page order --------------------------------
    def batch_get(self, keys, target_locations=None, target_sizes=None) -> list:
        tier = self._require_pool()
        pool = self.mem_pool_host
        targets = list(target_locations or [pool.get_dummy_flat_data_page() for _ in keys])

        def fill(rows: torch.Tensor, start: int, n: int) -> None:
            for i in range(n):
                tier.mover.compact_to_flat(rows[i], targets[start + i])

        found = self._run(tier.read_staged(self._keys(keys), fill), 0) if keys else 0
        self._count_get(len(keys), found)
        return [t if i < found else None for i, t in enumerate(targets)]

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None):
        targets = None if target_location is None else [target_location]
        return self.batch_get([key], targets)[0]

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        tier = self._require_pool()
        values = list(values or [])
        if len(values) != len(keys):
            raise ValueError(f"{len(values)} values for {len(keys)} keys")

        def take(rows: torch.Tensor, start: int, n: int) -> None:
            for i in range(n):
                tier.mover.flat_to_compact(values[start + i], rows[i])

        ok = self._run(tier.write_staged(self._keys(keys), take), False) if keys else True
        self._count_set(len(keys), ok)
        return ok

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        if value is None:
            raise ValueError("set needs the page's value (a flat host page)")
        return self.batch_set([key], [value])

    # -- housekeeping --------------------------------------------------------------------
    def _count_get(self, asked: int, found: int) -> None:
        s = self.stats
        s.get_pages += asked
        s.hit_pages += found
        s.miss_pages += asked - found
        self._metrics["prefetch_pgs"].append(found)

    def _count_set(self, offered: int, ok: bool) -> None:
        self.stats.set_pages += offered
        self.stats.set_failed_pages += 0 if ok else offered
        self._metrics["backup_pgs"].append(offered if ok else 0)

    def get_stats(self):
        """SGLang's StorageMetrics (pages per call since the last get_stats), with
        kvrelay's cumulative counters as its `kvrelay` attribute."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        metrics = StorageMetrics()
        metrics.prefetch_pgs.extend(self._metrics["prefetch_pgs"])
        metrics.backup_pgs.extend(self._metrics["backup_pgs"])
        for pages in self._metrics.values():
            pages.clear()
        metrics.kvrelay = dict((name, getattr(self.stats, name)) for name in AdapterStats.__slots__)
        return metrics

    def clear(self) -> None:
        """Drop this model's pages (its namespace) from every cache server."""
        if self.tier is not None:
            self._run(self.tier.clear(), None)

    def close(self) -> None:
        if self.tier is not None:
            try:  # closing waits for no server, but give it room on a loaded host
                self._loop.run(self.tier.close(), CLOSE_BOUND_S)
            except Exception:
                log.exception("kvrelay HiCache backend did not close cleanly")
            self.tier = None
        self._loop.stop()
