"""HiCache's v2 storage interface for `KvrelayHiCacheStorage`: named host pools.

SGLang's hybrid cache controller registers the KV pool (v1, then again by
name) and each extra pool by name, then calls `on_host_pools_registered`;
sidecars added later (a draft pool) arrive by name alone. It backs up the
extra pools with `batch_set_v2` before the KV pages (`batch_set_v1`), asks
`batch_exists_v2(keys, pool_transfers)` for the prefix every pool can
restore, and reads the KV pages (`batch_get_v1`) and then the extra pools
(`batch_get_v2`). How pools map onto pages: `pools`.

The target's tier is `RankTier` (rectangles of uniform pages, as v1 has it)
or, once an indexer pool joins the page, `PageTier` (a part per pool). Draft
pages get a tier of their own, in the draft namespace.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from kvrelay.adapters.sglang import pools as P
from kvrelay.adapters.sglang.identity import (
    PoolGeometry,
    UnsupportedPool,
    kvrelay_key,
    model_spec,
    pool_geometry,
    rank_rectangle,
)
from kvrelay.adapters.sglang.page_tier import PageTier, index_part, latent_part
from kvrelay.adapters.sglang.pool_io import PoolMover
from kvrelay.adapters.sglang.tier_io import RankTier

log = logging.getLogger(__name__)

ALL_PAGES, TRAILING_PAGES = "all_pages", "trailing_pages"


def policy_of(transfer) -> str:
    return P.pool_name(getattr(transfer, "hit_policy", ALL_PAGES))


class TierRoutes:
    """Which tier and part serve each pool, built from the registered pools."""

    def __init__(self, backend) -> None:
        b = self.backend = backend
        anchor = b.mem_pool_host
        self.geometry = pool_geometry(anchor, b.config.mla_rope_interleave)
        spec = model_spec(b.config, b.storage_config, self.geometry)
        self.rect = rank_rectangle(spec, b.storage_config, self.geometry)
        indexer_pool = b.named_pools.get(P.INDEXER)
        self.indexer = None
        if indexer_pool is not None:
            self.indexer = P.indexer_geometry(indexer_pool, self.geometry)
            spec = P.indexed_spec(spec, self.indexer, b.config, b.storage_config.pp_size)
        self.spec = spec
        self.draft_spec = None
        self.draft_parts: dict[str, object] = {}
        self._draft_pool = b.named_pools.get(P.DRAFT)
        if self._draft_pool is not None:
            self._plan_sidecar_draft()
        elif anchor.layer_num > self.geometry.local_layers:
            self._plan_packed_draft(anchor, indexer_pool)

    def _draft_geometry(self, pool) -> PoolGeometry:
        g = pool_geometry(pool, self.backend.config.mla_rope_interleave)
        if g.local_layers != int(pool.layer_num):
            raise UnsupportedPool("a draft pool with packed layers of its own")
        return g

    def _plan_sidecar_draft(self) -> None:
        b = self.backend
        self.draft_geometry = g = self._draft_geometry(self._draft_pool)
        indexer_pool = b.named_pools.get(P.DRAFT_INDEXER)
        indexer = P.indexer_geometry(indexer_pool, g) if indexer_pool is not None else None
        if indexer is not None and g.attention_kind != "mla":
            raise UnsupportedPool("a draft indexer beside an MHA draft pool")
        tp = b.storage_config.tp_size
        self.draft_spec = P.draft_spec(self.spec, g, b.config, indexer, tp)
        if indexer is not None:
            layers = range(g.local_layers)
            self.draft_parts = {
                P.DRAFT: latent_part(self.draft_spec, self._draft_pool, layers, layers,
                                     _pairs(g)),
                P.DRAFT_INDEXER: index_part(
                    self.draft_spec, indexer_pool, range(len(indexer.host_layers)),
                    [layer - g.start_layer for layer in indexer.host_layers],
                ),
            }  # fmt: skip

    def _plan_packed_draft(self, anchor, indexer_pool) -> None:
        """SGLang's MTP layers packed after the target's in its host pools."""
        g = self.geometry
        packed = int(anchor.layer_num) - g.local_layers
        if g.attention_kind != "mla":
            log.warning(
                "kvrelay HiCache backend: %d packed draft layers of an MHA pool are not "
                "stored (speculative acceptance after a hit is that of a cold draft)",
                packed,
            )
            return
        draft = replace(g, local_layers=packed, start_layer=0)
        indexer = self.indexer if self.indexer and self.indexer.packed_layers else None
        if indexer is not None and indexer.packed_layers != packed:
            raise UnsupportedPool("packed draft indexer layers differ from packed KV layers")
        self.draft_geometry = draft
        if indexer is not None:  # one indexer layer per packed layer
            indexer = replace(indexer, host_layers=tuple(range(packed)))
        self.draft_spec = P.draft_spec(self.spec, draft, self.backend.config, indexer, 1)
        tails = range(g.local_layers, g.local_layers + packed)
        self.draft_parts = {
            P.KV: latent_part(self.draft_spec, anchor, tails, range(packed), _pairs(g))
        }
        if indexer is not None:
            first = len(self.indexer.host_layers)
            self.draft_parts[P.INDEXER] = index_part(
                self.draft_spec, indexer_pool, range(first, first + packed), range(packed)
            )

    # -- tiers --------------------------------------------------------------------
    def target_tier(self):
        b = self.backend
        writer = self.rect.writer
        if self.indexer is None:
            mover = PoolMover(b.mem_pool_host, self.geometry, self.rect.num_bytes(self.spec))
            return RankTier(b.config, self.spec, self.rect, mover)
        local = range(self.geometry.local_layers)
        layers = [self.geometry.start_layer + i for i in local]
        parts = {
            P.KV: latent_part(self.spec, b.mem_pool_host, local, layers, _pairs(self.geometry)),
            P.INDEXER: index_part(self.spec, b.named_pools[P.INDEXER],
                                  range(len(self.indexer.host_layers)), self.indexer.host_layers),
        }  # fmt: skip
        return PageTier(b.config, self.spec, parts, writer)

    def draft_tier(self):
        if self.draft_spec is None:
            return None
        b = self.backend
        slot = self.spec.page_bytes
        if self.draft_spec.page_bytes > slot:
            raise UnsupportedPool("draft pages larger than the target's do not fit its slots")
        if self.draft_parts:
            return PageTier(b.config, self.draft_spec, self.draft_parts, self.rect.writer, slot)
        g = self.draft_geometry
        rect = rank_rectangle(self.draft_spec, b.storage_config, g)
        mover = PoolMover(self._draft_pool, g, rect.num_bytes(self.draft_spec))
        return RankTier(b.config, self.draft_spec, rect, mover, slot)


def _pairs(g: PoolGeometry) -> int:
    return g.rope_head_dim if g.rope_pairs else 0


async def tier_read(tier, part: str, keys, host_indices) -> int:
    if isinstance(tier, PageTier):
        return await tier.read(part, keys, host_indices)
    return await tier.read_pool(keys, host_indices)


async def tier_write(tier, part: str, keys, host_indices) -> bool:
    if isinstance(tier, PageTier):
        return await tier.write(part, keys, host_indices)
    return await tier.write_pool(keys, host_indices)


async def tier_exists(tier, keys) -> int:
    if isinstance(tier, PageTier):
        return await tier.exists(keys)
    return await tier.clients[0][0].count_prefix(keys) if keys else 0


async def trailing_restorable(tier, keys, window: int) -> set[int]:
    """Prefix lengths p (1..len(keys)) whose last `window` pages are all in."""
    present = await asyncio.gather(*(tier_exists(tier, [key]) for key in keys))
    return {
        p for p in range(1, len(keys) + 1) if all(present[i] for i in range(max(0, p - window), p))
    }


class V2Pools:
    """Mixin of `KvrelayHiCacheStorage`: the v2 calls over `TierRoutes`."""

    named_pools: dict
    draft = None

    def draft_keys(self, keys: list[str]) -> list[bytes]:
        return [kvrelay_key(self.draft_namespace, k) for k in keys]

    def pool_tier(self, name: str):
        """(tier, part, keys function) serving pool `name`."""
        if name in (P.KV, P.INDEXER):
            if name == P.INDEXER and self.routes.indexer is None:
                raise UnsupportedPool("no indexer pool is registered")
            return self.target, name, self._keys
        if self.draft is None:
            raise UnsupportedPool(f"no {name} pool is registered")
        return self.draft, name, self.draft_keys

    async def _exists_v2(self, keys: list[str], transfers) -> tuple[int, dict, list[int]]:
        names = self._keys(keys)
        kv = await tier_exists(self.target, names)
        hits = {P.KV: kv} if kv else {}
        restorable = set(range(1, kv + 1))
        for transfer in transfers or []:
            name = P.pool_name(transfer.name)
            if name in (P.KV, P.INDEXER):
                continue  # one page: sealed means both are in
            if self.draft is None or not restorable:
                restorable = set()
                continue
            drafts = self.draft_keys(keys[:kv])
            if policy_of(transfer) == TRAILING_PAGES:
                window = max(1, len(transfer.keys or ()))
                pool = await trailing_restorable(self.draft, drafts, window)
            else:
                pool = set(range(1, await tier_exists(self.draft, drafts) + 1))
            if pool:
                hits[transfer.name] = max(pool)
            restorable &= pool
        if P.INDEXER in {P.pool_name(t.name) for t in transfers or []} and kv:
            hits[P.INDEXER] = kv
        return max(restorable, default=0), hits, sorted(restorable)

    async def _move_v2(self, transfers, write: bool) -> dict:
        results = {}
        for transfer in transfers:
            name = P.pool_name(transfer.name)
            keys = list(transfer.keys or [])
            tier, part, key_fn = self.pool_tier(name)
            if write:
                ok = await tier_write(tier, part, key_fn(keys), transfer.host_indices)
                ok = await self._packed_draft(name, keys, transfer.host_indices, True) and ok
                results[transfer.name] = [ok] * len(keys)
            else:
                found = await tier_read(tier, part, key_fn(keys), transfer.host_indices)
                await self._packed_draft(name, keys[:found], transfer.host_indices, False)
                results[transfer.name] = [i < found for i in range(len(keys))]
        return results

    async def _packed_draft(self, name: str, keys, host_indices, write: bool) -> bool:
        """A packed draft's part rides with the target pool's call (best effort on reads)."""
        if name not in (P.KV, P.INDEXER) or not self.routes.draft_parts:
            return True
        if name not in self.routes.draft_parts or not keys:
            return True
        if write:
            return await tier_write(self.draft, name, self.draft_keys(keys), host_indices)
        await tier_read(self.draft, name, self.draft_keys(keys), host_indices)
        return True
