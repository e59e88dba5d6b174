"""Export and import of a request's KV as unified pages.

A rank exports its rectangle (its KV heads x its layers) of the full pages
of a cached prefix into page objects (rows of a uint8 arena of
`spec.page_bytes` each) with one `gather_pages` call; a rank of any other
parallel config imports the rectangle it owns with one `scatter_pages` call
and indexes the pages under their keys, so its next request with that prefix
computes only the suffix. When TP exceeds the KV heads, only the first
replica of a head writes it (`Rectangle.writer`); every replica reads it.
"""

from __future__ import annotations

import torch

from kvrelay.cuda_ext import gather_pages, rect_geometry, scatter_pages
from kvrelay.layout import rank_rectangle
from kvrelay.model.engine import Engine
from kvrelay.model.errors import PrefixNotCached


def _arena_rows(page_ids, count: int) -> torch.Tensor:
    ids = torch.as_tensor(page_ids, dtype=torch.int64)
    if ids.dim() != 1 or ids.numel() < count:
        raise ValueError(f"need {count} arena rows, got page_ids of shape {tuple(ids.shape)}")
    return ids[:count].contiguous()


def export_prefix(engine: Engine, tokens, arena: torch.Tensor, page_ids=None) -> int:
    """Write this rank's rectangle of every full page of `tokens` (which must be
    cached in the pool) into `arena` rows `page_ids` (default 0, 1, ...).
    Returns the number of pages."""
    spec, pool = engine.spec, engine.pool
    keys = spec.page_keys(list(tokens))
    pages = pool.match_prefix(keys)
    try:
        if len(pages) < len(keys):
            raise PrefixNotCached(
                f"{len(pages)} of {len(keys)} pages of the prefix are cached on this rank"
            )
        rect = rank_rectangle(spec, engine.parallel)
        if rect.writer and pages:
            ids = _arena_rows(range(len(pages)) if page_ids is None else page_ids, len(pages))
            slots = pool.slots(pages, len(pages) * spec.page_size).view(len(pages), -1)
            gather_pages(
                pool.k_layers, pool.v_layers, arena, ids, slots, **rect_geometry(spec, rect)
            )
    finally:
        pool.release(pages)
    return len(keys)


def import_prefix(engine: Engine, tokens, arena: torch.Tensor, page_ids=None) -> int:
    """Read this rank's rectangle of the full pages of `tokens` from `arena` into
    fresh pool pages and index them. Pages already cached are kept, not
    overwritten. Returns the number of pages now cached for the prefix.
    PoolExhausted (nothing taken) when the pool cannot hold them."""
    spec, pool = engine.spec, engine.pool
    keys = spec.page_keys(list(tokens))
    ids = _arena_rows(range(len(keys)) if page_ids is None else page_ids, len(keys))
    have = pool.match_prefix(keys)
    try:
        fresh = pool.allocate(len(keys) - len(have))
    except Exception:
        pool.release(have)
        raise
    try:
        if fresh:
            rect = rank_rectangle(spec, engine.parallel)
            slots = pool.slots(fresh, len(fresh) * spec.page_size).view(len(fresh), -1)
            scatter_pages(
                pool.k_layers,
                pool.v_layers,
                arena,
                ids[len(have) :].contiguous(),
                slots,
                **rect_geometry(spec, rect),
            )
            for page, key in zip(fresh, keys[len(have) :], strict=True):
                pool.register(page, key)
    finally:
        pool.release(have + fresh)
    return len(keys)
