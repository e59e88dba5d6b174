"""Memory-bounded attention over a paged context (the default backend).

A sequence's queries are its last `L` tokens; its context is `cached` tokens
before them plus the `L` new ones. Attention is computed as partial states
that are merged by log-sum-exp, never as one `L x context` score matrix:

- the cached part, every query sees every key: the context's pages are
  walked in chunks of at most `chunk_tokens` tokens; a chunk whose pages are
  consecutive in the pool is a view (read in place, no copy), otherwise its
  pages are gathered (a copy bounded by the chunk, not by the context);
- the new part, causal: query i sees new keys 0..i.

Each part yields (output, lse), the normalised output and the log of its
softmax denominator per query and head; two states over disjoint keys merge
exactly into the state over their union. With the engine's chunked prefill
bounding `L`, peak memory per layer is bounded by configuration (`L`, the
chunk size), not by the context length.

A block's state comes from PyTorch's fused CPU flash-attention kernel, which
returns the log-sum-exp beside the output and walks the keys in blocks of its
own; `attend_block_reference` is the same function in plain tensor algebra
(used where the fused kernel is unavailable, and as its test oracle).
"""

from __future__ import annotations

import torch

from kvrelay.model.attention import AttentionBatch

DEFAULT_CHUNK_TOKENS = 8192

_FUSED = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def attend_block_reference(q, k, v, scale: float, causal: bool):
    """q [q_heads, L, D], k/v [kv_heads, T, D] -> (out [q_heads, L, D] in the
    accumulation dtype, lse [q_heads, L]). `causal` needs L == T."""
    acc = accumulation_dtype(q.dtype)
    heads, length, dim = q.shape
    kv_heads = k.size(0)
    group = heads // kv_heads
    # Query heads h*group .. h*group+group-1 share KV head h (HF's repeat_kv).
    qg = q.to(acc).reshape(kv_heads, group * length, dim)
    scores = torch.matmul(qg, k.to(acc).transpose(1, 2)) * scale
    if causal:
        visible = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        scores = scores.view(kv_heads, group, length, length).masked_fill(~visible, -torch.inf)
        scores = scores.view(kv_heads, group * length, length)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse[..., None]), v.to(acc))
    return out.view(heads, length, dim), lse.view(heads, length)


def attend_block(q, k, v, scale: float, causal: bool):
    """`attend_block_reference` through the fused kernel where it runs."""
    if _FUSED is None or q.device.type != "cpu":
        return attend_block_reference(q, k, v, scale, causal)
    out, lse = _FUSED(q[None], k[None], v[None], 0.0, causal, scale=scale)
    acc = accumulation_dtype(q.dtype)
    return out[0].to(acc), lse[0].to(acc)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def merge_states(out_a, lse_a, out_b, lse_b):
    """The state over the union of two disjoint key sets."""
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a * torch.exp(lse_a - lse)[..., None] + out_b * torch.exp(lse_b - lse)[..., None]
    return out, lse


def context_chunks(table: torch.Tensor, tokens: int, page_size: int, chunk_pages: int):
    """(pages, tokens) of each chunk of a context's first `tokens` tokens:
    at most `chunk_pages` pages each, the last one trimmed."""
    pages = -(-tokens // page_size)
    for first in range(0, pages, chunk_pages):
        chunk = table[first : min(first + chunk_pages, pages)]
        yield chunk, min(tokens - first * page_size, chunk.numel() * page_size)


def read_pages(pool_pages: torch.Tensor, chunk: torch.Tensor, tokens: int) -> torch.Tensor:
    """[heads, tokens, dim] of a chunk's keys or values: a view of the pool
    when its pages are consecutive, else a gathered copy of the chunk only."""
    first = int(chunk[0])
    consecutive = chunk.numel() == 1 or bool(
        torch.equal(chunk, torch.arange(first, first + chunk.numel(), device=chunk.device))
    )
    if consecutive:
        rows = pool_pages[first : first + chunk.numel()]
    else:
        rows = pool_pages.index_select(0, chunk)
    return rows.flatten(0, 1)[:tokens].transpose(0, 1)


class PagedOnlineSoftmaxBackend:
    """Attention over pool pages read chunk by chunk, merged by log-sum-exp."""

    def __init__(self, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        if chunk_tokens <= 0:
            raise ValueError("chunk_tokens must be positive")
        self.chunk_tokens = chunk_tokens

    def attend(self, q, k_pool, v_pool, batch: AttentionBatch, scale: float):
        out = torch.empty_like(q)
        heads, dim = k_pool.shape[1:]
        ps = batch.page_size
        k_pages = k_pool.view(-1, ps, heads, dim)
        v_pages = v_pool.view(-1, ps, heads, dim)
        chunk_pages = max(1, self.chunk_tokens // ps)
        for start, length, context, table in zip(
            batch.query_starts,
            batch.query_lens,
            batch.context_lens,
            batch.page_tables,
            strict=True,
        ):
            query = q[start : start + length].transpose(0, 1)  # [q_heads, L, D]
            cached = context - length
            state = self._new_part(query, k_pool, v_pool, table, cached, context, ps, scale)
            for chunk, tokens in context_chunks(table, cached, ps, chunk_pages):
                k = read_pages(k_pages, chunk, tokens)
                v = read_pages(v_pages, chunk, tokens)
                state = merge_states(*state, *attend_block(query, k, v, scale, causal=False))
            out[start : start + length] = state[0].transpose(0, 1).to(q.dtype)
        return out

    @staticmethod
    def _new_part(query, k_pool, v_pool, table, cached, context, ps, scale):
        """The causal state of the new tokens over themselves (their K and V
        were written to the pool before attention)."""
        positions = torch.arange(cached, context, dtype=torch.int64, device=table.device)
        slots = table[positions // ps] * ps + positions % ps
        k = k_pool.index_select(0, slots).transpose(0, 1)
        v = v_pool.index_select(0, slots).transpose(0, 1)
        return attend_block(query, k, v, scale, causal=query.size(1) > 1)
