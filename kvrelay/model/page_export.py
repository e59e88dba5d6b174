"""Export and import of a request's KV as unified pages.

A rank exports its rectangle (its KV heads x its layers) of the pages of a
cached token sequence into page objects (rows of a uint8 arena of
`spec.page_bytes` each) with one `gather_pages` call (`page_copy`: on the
pool's device); a rank of any other
parallel config imports the rectangle it owns with one `scatter_pages` call
and indexes the pages, so its next request with those tokens computes only
what follows. Full pages are indexed under their chained keys; a trailing
partial page (the tail of a prompt that travels from prefill to decode) is
exported with zeros past its last token and indexed under its local partial
key (`kvrelay.model.pool.partial_page_key`). When TP exceeds the KV heads,
only the first replica of a head writes it (`Rectangle.writer`); every
replica reads it. Under CP, page i is exported by CP rank i % cp only
(`ParallelConfig.owns_page`), and every CP rank imports every page (each
holds the whole sequence).
"""

from __future__ import annotations

import torch

from kvrelay.layout import rank_rectangle
from kvrelay.model.engine import Engine
from kvrelay.model.errors import PrefixNotCached
from kvrelay.model.page_copy import gather_rect, scatter_rect
from kvrelay.model.pool import partial_page_key


def _arena_rows(page_ids, count: int) -> torch.Tensor:
    ids = torch.as_tensor(page_ids, dtype=torch.int64)
    if ids.dim() != 1 or ids.numel() < count:
        raise ValueError(f"need {count} arena rows, got page_ids of shape {tuple(ids.shape)}")
    return ids[:count].contiguous()


def _page_keys(engine: Engine, tokens, chain=None, first_page: int = 0) -> list[bytes]:
    """Index keys of pages [first_page, ...) of `tokens`: the chain for full
    pages (`chain`, when the caller computed it already, at least as long),
    then the partial key of a trailing partial page. With `chain` only the
    tail's tokens are read (a windowed import must not walk the context)."""
    ps = engine.spec.page_size
    full = len(tokens) // ps
    if chain is None:
        chain = engine.spec.page_keys([int(t) for t in tokens[: full * ps]])
    keys = list(chain[first_page:full])
    tail = len(tokens) % ps
    if tail:
        parent = chain[full - 1] if full else engine.namespace
        keys.append(partial_page_key(parent, [int(t) for t in tokens[full * ps :]]))
    return keys


def _slot_mapping(engine: Engine, pages: list[int], first: int, num_tokens: int) -> torch.Tensor:
    """int64 [len(pages), page_size]: slots of the tokens of sequence pages
    first, first + 1, ... held on pool `pages`; -1 past the last token."""
    ps = engine.spec.page_size
    positions = torch.arange(len(pages) * ps, dtype=torch.int64) + first * ps
    table = torch.as_tensor(pages, dtype=torch.int64)
    slots = table.repeat_interleave(ps) * ps + positions % ps
    slots[positions >= num_tokens] = -1
    return slots.view(len(pages), ps)


def export_prefix(
    engine: Engine, tokens, arena: torch.Tensor, page_ids=None, first_page: int = 0, chain=None
) -> int:
    """Write this rank's rectangle of pages [first_page, ...) of `tokens` (all
    cached in the pool, a trailing partial page included) into `arena` rows
    `page_ids` (default 0, 1, ...; one per exported page). Returns the number
    of pages of `tokens`. `chain`: the full pages' keys, if already known."""
    spec, pool = engine.spec, engine.pool
    keys = _page_keys(engine, tokens, chain)
    rect = rank_rectangle(spec, engine.parallel)

    def gather(ids: torch.Tensor, slots: torch.Tensor) -> None:
        gather_rect(pool, arena, ids, slots, spec, rect)

    _export_rows(engine, pool, keys, page_ids, first_page, len(tokens), rect.writer, gather)
    return len(keys)


def import_prefix(
    engine: Engine, tokens, arena: torch.Tensor, page_ids=None, chain=None, first_page: int = 0
) -> int:
    """Read this rank's rectangle of pages [first_page, ...) of `tokens` from
    `arena` rows `page_ids` (default 0, 1, ...; one per page from
    `first_page` on) into fresh pool pages and index them. Pages already
    cached are kept, not overwritten. Returns the number of pages of `tokens`.
    PoolExhausted (nothing taken) when the pool cannot hold them. `chain`:
    the full pages' keys, if already known. A windowed import (`first_page`
    > 0, pages before it imported by earlier windows) costs the window, not
    the context: the tokens before it are not read nor matched (should an
    earlier page have been evicted meanwhile, the prefix match stops there
    and the engine computes from it)."""
    spec, pool = engine.spec, engine.pool
    keys = _page_keys(engine, tokens, chain, first_page)
    ids = _arena_rows(range(len(keys)) if page_ids is None else page_ids, len(keys))

    def scatter(fresh: list[int], cached: int, rows: torch.Tensor) -> None:
        slots = _slot_mapping(engine, fresh, first_page + cached, len(tokens))
        scatter_rect(pool, arena, rows, slots, spec, rank_rectangle(spec, engine.parallel))

    _import_rows(pool, keys, ids, scatter)
    return first_page + len(keys)


def _import_rows(pool, keys: list[bytes], ids: torch.Tensor, scatter) -> None:
    """The import both page kinds share (target and draft): the pages of
    `keys` not cached yet get fresh pool pages, filled by
    `scatter(fresh, cached, rows)` (`cached` pages of `keys` were already
    there; `rows` are the arena rows of the fresh ones) and indexed. Cached
    pages are kept; PoolExhausted (nothing taken) when the pool cannot hold
    the rest."""
    have = pool.match_prefix(keys)
    try:
        fresh = pool.allocate(len(keys) - len(have))
    except Exception:
        pool.release(have)
        raise
    try:
        if fresh:
            scatter(fresh, len(have), ids[len(have) :].contiguous())
            for page, key in zip(fresh, keys[len(have) :], strict=True):
                pool.register(page, key)
    finally:
        pool.release(have + fresh)


def _export_rows(engine, pool, keys, page_ids, first_page, num_tokens, writer, gather) -> None:
    """The export both page kinds share (target and draft): every page of
    `keys` must be cached (PrefixNotCached otherwise); pages [first_page, ...)
    this rank writes (a rectangle's writer; under CP, where every rank holds
    every page, page i is written by CP rank i % cp only) go to arena rows
    `page_ids` (default 0, 1, ...) by `gather(rows, slots)`."""
    pages = pool.match_prefix(keys)
    try:
        if len(pages) < len(keys):
            raise PrefixNotCached(f"{len(pages)} of {len(keys)} pages are cached on this rank")
        count = len(pages) - first_page
        owned = [
            i - first_page for i in range(first_page, len(pages)) if engine.parallel.owns_page(i)
        ]
        if writer and owned:
            ids = _arena_rows(range(count) if page_ids is None else page_ids, count)
            slots = _slot_mapping(engine, pages[first_page:], first_page, num_tokens)
            gather(ids[owned].contiguous(), slots[owned].contiguous())
    finally:
        pool.release(pages)
