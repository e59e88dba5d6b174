"""Draft (MTP) pages: their keys and the rectangle a rank owns of them.

A draft slot t is computed from the target's hidden state at t (which
depends on tokens 0..t) and token t + 1, so the bytes of draft page p depend
on every token of pages 0..p and on the first token of page p + 1:

    draft_key[p] = sha256(draft namespace || target key[p] || token (p + 1) * page_size
                          as uint32 little-endian)

Two prompts that share target page p but differ at the first token of page
p + 1 therefore never share draft page p, and a draft page has a key only
once that next token is known.

The draft's one MTP layer runs on the last PP stage, its KV heads split over
TP like a target layer's: a draft page is one layer deep, and every rank of
the last stage owns its heads of it; other stages own none.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from kvrelay.layout.keys import tokens_as_uint32
from kvrelay.layout.parallel import ParallelConfig, Rectangle, rank_rectangle
from kvrelay.layout.spec import DIGEST_BYTES, LayoutError, ModelKVSpec


def draft_page_keys(
    draft: ModelKVSpec, target_keys: Sequence[bytes], tokens: Sequence[int], start: int = 0
) -> list[bytes]:
    """Keys of draft pages start, start + 1, ... whose bytes `tokens` (the whole
    sequence) determine: one per target key (`target_keys[i]` is page
    start + i's) while token (page + 1) * page_size is present in `tokens`."""
    if draft.target_namespace is None:
        raise LayoutError("draft_page_keys needs a draft spec (target_namespace set)")
    namespace = draft.namespace()
    ps = draft.page_size
    count = min(len(target_keys), max(0, (len(tokens) - 1) // ps - start))
    if count <= 0:
        return []
    nexts = tokens_as_uint32([tokens[(start + i + 1) * ps] for i in range(count)])
    keys = []
    for i in range(count):
        if not isinstance(target_keys[i], bytes) or len(target_keys[i]) != DIGEST_BYTES:
            raise LayoutError("target keys must be 32-byte digests")
        data = namespace + target_keys[i] + nexts[i : i + 1].tobytes()
        keys.append(hashlib.sha256(data).digest())
    return keys


def draft_rectangle(draft: ModelKVSpec, parallel: ParallelConfig) -> Rectangle | None:
    """The rectangle of a draft page `parallel`'s rank holds: its TP heads of
    the draft's layers on the last PP stage, None on other stages."""
    if parallel.pp_rank != parallel.pp - 1:
        return None
    flat = ParallelConfig(tp=parallel.tp, tp_rank=parallel.tp_rank)
    return rank_rectangle(draft, flat)
