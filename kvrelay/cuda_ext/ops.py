"""Gather and scatter of KV between an engine's paged pool and unified pages.

An engine keeps, per layer, K and V tensors addressed by token *slot*:
[num_slots, local_heads, head_dim] views of its paged pool (slot = engine page
* engine page size + offset, so any engine page size works). A unified page
object is bytes laid out as page[head][layer] = K[token] ++ V[token]
(DESIGN.md section 3). One call moves every layer and head of a rectangle for
every page of a request; there is no Python loop over layers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvrelay.cuda_ext.backend import BACKEND
from kvrelay.layout import LayoutError, ModelKVSpec, Rectangle


def gather_pages(
    k_layers: Sequence[torch.Tensor],
    v_layers: Sequence[torch.Tensor],
    pages: torch.Tensor,
    page_ids: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    page_heads: int,
    page_layers: int,
    page_head_start: int = 0,
    page_layer_start: int = 0,
    pool_head_start: int = 0,
    num_heads: int | None = None,
) -> None:
    """Copy pool KV into page objects.

    k_layers / v_layers: one [num_slots, pool_heads, head_dim] tensor per layer
    of the rectangle (v_layers empty for MLA); rows contiguous.
    pages: uint8 [arena_pages, page_bytes]; page i of the call is row page_ids[i].
    slot_mapping: int64 [num_pages, page_size], the pool slot of each token;
    -1 marks no token, whose bytes gather fills with zeros.
    The rectangle is heads [page_head_start, +num_heads) x layers
    [page_layer_start, +len(k_layers)) of a page object of page_heads x
    page_layers blocks; its heads are pool heads [pool_head_start, +num_heads).
    """
    heads = _default_heads(k_layers, pool_head_start, num_heads)
    BACKEND.gather_pages(
        list(k_layers),
        list(v_layers),
        pages,
        page_ids,
        slot_mapping,
        page_heads,
        page_layers,
        page_head_start,
        page_layer_start,
        pool_head_start,
        heads,
    )


def scatter_pages(
    k_layers: Sequence[torch.Tensor],
    v_layers: Sequence[torch.Tensor],
    pages: torch.Tensor,
    page_ids: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    page_heads: int,
    page_layers: int,
    page_head_start: int = 0,
    page_layer_start: int = 0,
    pool_head_start: int = 0,
    num_heads: int | None = None,
) -> None:
    """Copy page-object rectangles into the pool; tokens with slot -1 are skipped."""
    heads = _default_heads(k_layers, pool_head_start, num_heads)
    BACKEND.scatter_pages(
        list(k_layers),
        list(v_layers),
        pages,
        page_ids,
        slot_mapping,
        page_heads,
        page_layers,
        page_head_start,
        page_layer_start,
        pool_head_start,
        heads,
    )


def _default_heads(k_layers, pool_head_start: int, num_heads: int | None) -> int:
    if num_heads is not None:
        return num_heads
    if not len(k_layers):
        raise ValueError("k_layers is empty: pass one K tensor per layer")
    return k_layers[0].size(1) - pool_head_start


def rect_geometry(spec: ModelKVSpec, rect: Rectangle, *, compact: bool = False) -> dict[str, int]:
    """Keyword arguments placing `rect` in a page object.

    Full page objects (default) are the wire and cache format: the rectangle
    lands at its place among all heads and layers. `compact=True` describes a
    buffer holding only the rectangle (num_heads x num_layers blocks), for a
    rank that stages just its share.
    """
    rect.check_inside(spec)
    if not spec.uniform:
        raise LayoutError(
            "the page ops take blocks of one size; pages with indexer keys are copied "
            "by kvrelay.model.latent_page_copy"
        )
    if compact:
        return {
            "page_heads": rect.num_heads,
            "page_layers": rect.num_layers,
            "page_head_start": 0,
            "page_layer_start": 0,
            "num_heads": rect.num_heads,
        }
    return {
        "page_heads": spec.num_kv_heads,
        "page_layers": spec.num_layers,
        "page_head_start": rect.head_start,
        "page_layer_start": rect.layer_start,
        "num_heads": rect.num_heads,
    }


def slot_mapping_from_block_table(
    block_table: torch.Tensor, engine_page_size: int, num_tokens: int, page_size: int
) -> torch.Tensor:
    """Slot of each token of a sequence, grouped into unified pages.

    block_table: int [num_engine_pages] the engine pages of the sequence, in
    order. Returns int64 [ceil(num_tokens / page_size), page_size], -1 past the
    last token.
    """
    if engine_page_size <= 0 or page_size <= 0 or num_tokens < 0:
        raise LayoutError("page sizes must be positive and num_tokens non-negative")
    needed = -(-num_tokens // engine_page_size)
    if block_table.numel() < needed:
        raise LayoutError(
            f"block table has {block_table.numel()} engine pages; {num_tokens} tokens need {needed}"
        )
    positions = torch.arange(num_tokens, dtype=torch.int64)
    table = block_table.to(torch.int64)
    slots = table[positions // engine_page_size] * engine_page_size + positions % engine_page_size
    num_pages = -(-num_tokens // page_size)
    out = torch.full((num_pages * page_size,), -1, dtype=torch.int64)
    out[:num_tokens] = slots
    return out.view(num_pages, page_size)
