"""Export and import of a prefix's draft (MTP) KV as unified draft pages.

The draft's pages ride beside the target's (`kvrelay.model.page_export`): same
page layout (one layer deep), same gather/scatter ops, their own arena rows,
keyed by `kvrelay.layout.draft_page_keys`. Only ranks of the last PP stage
hold the MTP layer; each moves its TP heads of every draft page
(`draft_rectangle`; a replicated head is written by its first replica).
Draft page p needs token (p + 1) * page_size, so a prefix of n tokens has
(n - 1) // page_size draft pages: one fewer than its full target pages when
n is page-aligned, and never a partial one.
"""

from __future__ import annotations

import torch

from kvrelay.layout import draft_page_keys, draft_rectangle
from kvrelay.model.engine import Engine
from kvrelay.model.page_copy import gather_rect, scatter_rect
from kvrelay.model.page_export import _arena_rows, _export_rows, _import_rows, _slot_mapping


def draft_keys(engine: Engine, tokens: list[int]) -> list[bytes]:
    """Keys of the draft pages `tokens` determine ([] without speculation)."""
    if engine.draft is None:
        return []
    return draft_page_keys(engine.draft.spec, engine.spec.page_keys(tokens), tokens)


def export_draft_prefix(
    engine: Engine, tokens, arena: torch.Tensor, page_ids=None, first_page: int = 0
) -> int:
    """Write this rank's rectangle of draft pages [first_page, n) of `tokens`
    into `arena` rows (default 0, 1, ...; row i holds page first_page + i).
    Returns n, the number of draft pages of `tokens`."""
    keys = draft_keys(engine, [int(t) for t in tokens])
    draft = engine.draft
    if not keys or draft.pool is None:  # no draft pages, or not on this rank
        return len(keys)
    rect = draft_rectangle(draft.spec, engine.parallel)

    def gather(ids: torch.Tensor, slots: torch.Tensor) -> None:
        gather_rect(draft.pool, arena, ids, slots, draft.spec, rect)

    # Under CP every rank holds every draft page (the draft runs whole on
    # each); draft page i is written by CP rank i % cp, as target page i.
    num_tokens = len(keys) * draft.page_size
    _export_rows(engine, draft.pool, keys, page_ids, first_page, num_tokens, rect.writer, gather)
    return len(keys)


def import_draft_prefix(engine: Engine, tokens, arena: torch.Tensor, page_ids=None) -> int:
    """Read this rank's rectangle of the draft pages of `tokens` from `arena`
    into fresh draft pool pages and index them (pages already cached are
    kept). Returns the number of draft pages of `tokens`."""
    keys = draft_keys(engine, [int(t) for t in tokens])
    draft = engine.draft
    if not keys or draft.pool is None:  # no draft pages, or not on this rank
        return len(keys)
    pool = draft.pool
    ids = _arena_rows(range(len(keys)) if page_ids is None else page_ids, len(keys))

    def scatter(fresh: list[int], cached: int, rows: torch.Tensor) -> None:
        slots = _slot_mapping(engine, fresh, cached, len(keys) * draft.page_size)
        rect = draft_rectangle(draft.spec, engine.parallel)
        scatter_rect(pool, arena, rows, slots, draft.spec, rect)

    _import_rows(pool, keys, ids, scatter)
    return len(keys)
