"""The attention backend seam.

The decoder writes each layer's new K and V into the paged pool, then asks a
backend for attention of the new queries over each sequence's context (the
cached pages plus the new tokens). The CPU reference backend gathers the
context's pages from the pool and calls
`torch.nn.functional.scaled_dot_product_attention`; a GPU backend (FlashInfer,
a paged kernel) would read the pages in place through the same slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class AttentionBatch:
    """Where each sequence's queries and context live (paged-attention metadata).

    Sequence i has `query_lens[i]` new tokens, rows [query_starts[i], +len) of
    the flattened query tensor, which are the last tokens of its context of
    `context_lens[i]` tokens; `page_tables[i]` (int64) lists the pool pages of
    that context in order, `page_size` tokens each.
    """

    query_starts: tuple[int, ...]
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    page_tables: tuple[torch.Tensor, ...]
    page_size: int

    def sequences(self):
        """(query start, query length, context length, page table) of each sequence."""
        return zip(
            self.query_starts, self.query_lens, self.context_lens, self.page_tables, strict=True
        )


class AttentionBackend(Protocol):
    def attend(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        batch: AttentionBatch,
        scale: float,
    ) -> torch.Tensor:
        """q: [tokens, q_heads, head_dim]; k_pool/v_pool: one layer's
        [slots, kv_heads, head_dim]. Returns [tokens, q_heads, head_dim]."""
        ...


class TorchSDPABackend:
    """Gathers each sequence's context from the pool; SDPA with a causal mask
    shifted so new token i sees the cached context and new tokens 0..i."""

    def attend(self, q, k_pool, v_pool, batch, scale):
        out = torch.empty_like(q)
        heads, dim = k_pool.shape[1:]
        # Whole pages are gathered (one index per page, page_size rows each),
        # then trimmed to the context.
        k_pages = k_pool.view(-1, batch.page_size, heads, dim)
        v_pages = v_pool.view(-1, batch.page_size, heads, dim)
        for start, length, context, table in batch.sequences():
            k = k_pages.index_select(0, table).view(-1, heads, dim)[:context].transpose(0, 1)
            v = v_pages.index_select(0, table).view(-1, heads, dim)[:context].transpose(0, 1)
            query = q[start : start + length].transpose(0, 1)  # [q_heads, length, head_dim]
            cached = context - length
            mask = None
            if length > 1 and cached > 0:
                # Key j is visible to new token i when j <= cached + i.
                rows = torch.arange(length, device=q.device)[:, None] + cached
                mask = torch.arange(context, device=q.device)[None, :] <= rows
            result = F.scaled_dot_product_attention(
                query[None],
                k[None],
                v[None],
                attn_mask=mask,
                # Nothing cached: plain causal attention, which lets SDPA pick a
                # kernel that skips the masked half instead of materialising it.
                is_causal=length > 1 and cached == 0,
                scale=scale,
                enable_gqa=query.size(0) != k.size(0),
            )
            out[start : start + length] = result[0].transpose(0, 1)
        return out
