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
import functools
import logging
import threading
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    PoolName,
    PoolTransferResult,
)

from kvrelay.adapters.sglang import pools as P
from kvrelay.adapters.sglang.config import AdapterConfig
from kvrelay.adapters.sglang.identity import UnsupportedPool, kvrelay_key
from kvrelay.adapters.sglang.page_tier import PageTier
from kvrelay.adapters.sglang.storage_v2 import TierRoutes, V2Pools, tier_exists
from kvrelay.adapters.sglang.tier_io import AdapterStats, RankTier

log = logging.getLogger(__name__)

# SGLang asks for the same pages twice (`batch_exists`, then `batch_get_v1`)
# and writes pages it computed just before: a page's key is hashed once.
_page_key = functools.lru_cache(maxsize=1 << 16)(kvrelay_key)

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


class KvrelayHiCacheStorage(V2Pools, HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        self.storage_config = storage_config
        self.config = AdapterConfig.from_extra_config(storage_config.extra_config)
        self.mem_pool_host = None
        self.named_pools: dict[str, object] = {}
        self.routes: TierRoutes | None = None
        self.target: RankTier | PageTier | None = None
        self.draft: RankTier | PageTier | None = None
        self.namespace = self.draft_namespace = b""
        self._registered = False  # the registration burst is over
        self._own_stats = AdapterStats()
        self._loop = _LoopThread()
        self._metrics = {"prefetch_pgs": [], "backup_pgs": []}

    # -- setup ------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Work out the model spec and the rank's rectangle, connect to the tier."""
        super().register_mem_pool_host(mem_pool_host)
        self._build()

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        """A named pool: kv (the anchor again), indexer, draft, draft_indexer;
        any other is refused (UnsupportedPool fails SGLang's attach)."""
        name = P.pool_name(host_pool_name)
        P.refuse_unheld(name)
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if name == P.KV:
            if self.mem_pool_host is None:
                self.register_mem_pool_host(host_pool)
            elif host_pool is not self.mem_pool_host:
                raise UnsupportedPool("a KV pool other than the one registered first")
            return
        self.named_pools[name] = host_pool
        if self._registered:  # a sidecar added after the burst
            self._build()

    def on_host_pools_registered(self) -> None:
        self._registered = True
        if self.named_pools:
            self._build()

    def _build(self) -> None:
        """(Re)connect the tiers the registered pools need; a target whose
        spec did not change keeps its tier."""
        routes = TierRoutes(self)
        old = self.routes
        if old is None or old.spec != routes.spec or self.target is None:
            self._close_tier("target")
            self.target = self._start(routes.target_tier())
        if old is None or old.draft_spec != routes.draft_spec or self.draft is None:
            self._close_tier("draft")
            tier = routes.draft_tier()
            self.draft = None if tier is None else self._start(tier)
        self.routes, self.spec, self.rect = routes, routes.spec, routes.rect
        self.namespace = routes.spec.namespace()
        draft = routes.draft_spec
        self.draft_namespace = draft.namespace() if draft is not None else b""
        self._log_identity(routes)

    def _start(self, tier):
        return self._loop.run(tier.start(), self.config.timeout_s)

    def _close_tier(self, which: str) -> None:
        tier = getattr(self, which)
        setattr(self, which, None)
        if tier is not None:
            try:
                self._loop.run(tier.close(), CLOSE_BOUND_S)
            except Exception:
                log.exception("kvrelay HiCache backend: a tier did not close cleanly")

    def _log_identity(self, routes: TierRoutes) -> None:
        spec, rect, g = routes.spec, routes.rect, routes.geometry
        fields = {k: v for k, v in spec.identity_fields().items() if k != "layout_version"}
        log.info(
            "kvrelay HiCache backend: namespace %s %s; layout %s, heads [%d, %d) "
            "layers [%d, %d)%s, pools %s%s",
            spec.namespace().hex()[:16], fields, g.layout, rect.head_start, rect.head_end,
            rect.layer_start, rect.layer_end, "" if rect.writer else " (reader)",
            ", ".join([P.KV, *self.named_pools]),
            f"; draft namespace {self.draft_namespace.hex()[:16]}" if self.draft else "",
        )  # fmt: skip

    @property
    def tier(self) -> RankTier | None:
        """The target's tier when its pages are rectangles (v1's), else None."""
        return self.target if isinstance(self.target, RankTier) else None

    @property
    def stats(self) -> AdapterStats:
        return self.tier.stats if self.tier is not None else self._own_stats

    def _require_pool(self):
        if self.target is None:
            raise RuntimeError("register_mem_pool_host must be called before page calls")
        return self.target

    def _keys(self, keys: list[str]) -> list[bytes]:
        return [_page_key(self.namespace, k) for k in keys]

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
        if isinstance(tier, PageTier):
            return self._run(tier_exists(tier, self._keys(keys)), 0)
        return self._run(tier.exists(self._keys(keys)), 0)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- zero-copy interface (interface_v1) -----------------------------------------------
    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info=None
    ) -> list[bool]:
        """Read each page's rectangle into the host pool; True for the cached prefix."""
        tier = self._require_pool()
        if isinstance(tier, PageTier) or self.routes.draft_parts:
            found = self._run(self._move_v2([_Transfer(P.KV, keys, host_indices)], False), {})
            found = sum(found.get(P.KV, []))
            self._count_get(len(keys), found)
            return [i < found for i in range(len(keys))]
        names = self._keys(keys)
        # Pages the lookup pulled are copied here, on SGLang's thread; only
        # what it did not hold goes to the loop (and the servers).
        found = self._take_ahead(tier, names, host_indices)
        if found < len(keys):
            rest = host_indices[found * tier.mover.page_size :]
            here = self._on_caller(tier.read_on_caller, names[found:], rest)
            found += here if here is not None else self._run(tier.read_pool(names[found:], rest), 0)
        self._count_get(len(keys), found)
        return [i < found for i in range(len(keys))]

    def _on_caller(self, call, names: list[bytes], host_indices):
        """`call` (a `RankTier` call on SGLang's thread); None where the loop must make it."""
        try:
            return call(names, host_indices)
        except Exception:  # never fails SGLang's request: the loop's call follows
            log.exception("kvrelay call on SGLang's thread failed")
            self.stats.errors += 1
            return None

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
        if isinstance(tier, PageTier) or self.routes.draft_parts:
            done = self._run(self._move_v2([_Transfer(P.KV, keys, host_indices)], True), {})
            ok = all(done.get(P.KV, [False])) if keys else True
            self._count_set(len(keys), ok)
            return [ok] * len(keys)
        if not keys:
            self._count_set(0, True)
            return []
        names = self._keys(keys)
        ok = self._on_caller(tier.write_on_caller, names, host_indices)
        if ok is None:
            ok = self._run(tier.write_pool(names, host_indices), False)
        self._count_set(len(keys), ok)
        return [ok] * len(keys)

    # -- v2: named pools (storage_v2) ---------------------------------------------------
    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None) -> PoolTransferResult:
        self._require_pool()
        if not keys:
            return PoolTransferResult(0, {}, [])
        final, hits, restorable = self._run(
            self._exists_v2(list(keys), pool_transfers), (0, {}, [])
        )
        hits = {PoolName(k) if isinstance(k, str) else k: v for k, v in hits.items()}
        return PoolTransferResult(final, hits, restorable)

    def batch_get_v2(self, transfers, extra_info=None) -> dict:
        self._require_pool()
        results = self._run(self._move_v2(list(transfers), False), None)
        if results is None:
            results = {t.name: [False] * len(t.keys or ()) for t in transfers}
        for t in transfers:
            self._count_get(len(t.keys or ()), sum(results[t.name]))
        return results

    def batch_set_v2(self, transfers, extra_info=None) -> dict:
        self._require_pool()
        results = self._run(self._move_v2(list(transfers), True), None)
        if results is None:
            results = {t.name: [False] * len(t.keys or ()) for t in transfers}
        for t in transfers:
            self._count_set(len(t.keys or ()), all(results[t.name]))
        return results

    # -- plain interface: flat pages in get_data_page order --------------------------------
    def _plain_tier(self) -> RankTier:
        if self.tier is None:
            raise UnsupportedPool(
                "pages filled from several pools move through the zero-copy interface: "
                'set "interface_v1": 1 in the extra config'
            )
        return self.tier

    def batch_get(self, keys, target_locations=None, target_sizes=None) -> list:
        self._require_pool()
        tier = self._plain_tier()
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
        self._require_pool()
        tier = self._plain_tier()
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
        """Drop this model's pages (its namespace, and its draft's) from every cache server."""
        for tier in (self.target, self.draft):
            if tier is not None:
                self._run(tier.clear(), None)

    def close(self) -> None:
        # closing waits for no server, but give it room on a loaded host
        self._close_tier("target")
        self._close_tier("draft")
        self._loop.stop()


class _Transfer:
    """A PoolTransfer's fields the v2 moves read (v1 calls routed through them)."""

    def __init__(self, name: str, keys, host_indices) -> None:
        self.name, self.keys, self.host_indices = name, keys, host_indices
