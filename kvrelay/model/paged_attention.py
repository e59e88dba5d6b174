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

import itertools

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


def attend_blocks(q, k, v, scale: float):
    """Causal `attend_block` of B equal-shaped blocks in one call: q [B, q_heads,
    L, D], k/v [B, kv_heads, L, D] -> (out [B, q_heads, L, D], lse [B, q_heads, L])."""
    if _FUSED is None or q.device.type != "cpu":
        states = [
            attend_block_reference(*block, scale, True) for block in zip(q, k, v, strict=True)
        ]
        return torch.stack([s[0] for s in states]), torch.stack([s[1] for s in states])
    out, lse = _FUSED(q, k, v, 0.0, True, scale=scale)[:2]
    acc = accumulation_dtype(q.dtype)
    return out.to(acc), lse.to(acc)


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


def new_keys(k_pool, v_pool, table, cached: int, context: int, ps: int):
    """[kv_heads, L, D] keys and values of a sequence's new tokens
    [cached, context), read from the pool (attention runs after the new
    tokens' K and V were written there)."""
    positions = torch.arange(cached, context, dtype=torch.int64, device=table.device)
    slots = table[positions // ps] * ps + positions % ps
    return (pool.index_select(0, slots).transpose(0, 1) for pool in (k_pool, v_pool))


def query_blocks(cached: int, context: int, page_size: int) -> list[tuple[int, int]]:
    """The new rows [cached, context) cut at page boundaries: global [start, end)
    of each query block (the first and last may be partial pages)."""
    cuts = range((cached // page_size + 1) * page_size, context, page_size)
    bounds = [cached, *cuts, context]
    return list(itertools.pairwise(bounds))


class PagedOnlineSoftmaxBackend:
    """Attention over pool pages read chunk by chunk, merged by log-sum-exp.

    By default a sequence's new rows go through the fused kernel in one causal
    call (plus one call per context chunk): fastest, but the kernel rounds a
    row differently depending on how many rows the call holds.

    `batch_invariant=True`: the new rows are attended in query blocks cut at
    global page boundaries, each over keys cut at global positions (its own
    page's keys causally, then the context before its page in chunks aligned
    to multiples of the chunk size), merged in that order. A row's arithmetic
    then depends only on its position and the tokens, never on how many rows
    or which other rows a forward holds, so a context-parallel prefill (whose
    chunks are whole pages) computes CP=1's bits. Equal-shaped full-page
    blocks go through the fused kernel as one batched call (its result per
    batch element does not depend on the batch). The price is smaller kernel
    calls (a page of rows each): about 1.4x the attention time of a 4096-token
    prefill at page size 64 on one CPU thread."""

    def __init__(self, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, batch_invariant=False) -> None:
        if chunk_tokens <= 0:
            raise ValueError("chunk_tokens must be positive")
        self.chunk_tokens = chunk_tokens
        self.batch_invariant = bool(batch_invariant)

    def attend(self, q, k_pool, v_pool, batch: AttentionBatch, scale: float):
        out = torch.empty_like(q)
        heads, dim = k_pool.shape[1:]
        ps = batch.page_size
        pages = (k_pool.view(-1, ps, heads, dim), v_pool.view(-1, ps, heads, dim))
        one = self._attend_in_page_blocks if self.batch_invariant else self._attend_whole
        for start, length, context, table in batch.sequences():
            query = q[start : start + length].transpose(0, 1)  # [q_heads, L, D]
            rows = one(query, k_pool, v_pool, pages, table, context - length, ps, scale)
            out[start : start + length] = rows.to(q.dtype)
        return out

    def _attend_whole(self, query, k_pool, v_pool, pages, table, cached, ps, scale):
        """One sequence's new rows [L, q_heads, D] in one causal call over
        their own keys, then one call per context chunk."""
        context = cached + query.shape[1]
        chunk_pages = max(1, self.chunk_tokens // ps)
        k, v = new_keys(k_pool, v_pool, table, cached, context, ps)
        state = attend_block(query, k, v, scale, causal=query.size(1) > 1)
        for chunk, tokens in context_chunks(table, cached, ps, chunk_pages):
            k, v = (read_pages(kv_pages, chunk, tokens) for kv_pages in pages)
            state = merge_states(*state, *attend_block(query, k, v, scale, causal=False))
        return state[0].transpose(0, 1)

    def _attend_in_page_blocks(self, query, k_pool, v_pool, pages, table, cached, ps, scale):
        """One sequence's new rows [L, q_heads, D], in query blocks cut at
        page boundaries (see the class docstring)."""
        context = cached + query.shape[1]
        chunk_pages = max(1, self.chunk_tokens // ps)
        blocks = query_blocks(cached, context, ps)
        states = self._diagonal(query, k_pool, v_pool, table, cached, blocks, ps, scale)
        # Each block's context before it, chunk by chunk; a chunk is read
        # once (up to the last block's start) and cut for each block.
        chunks = context_chunks(table, blocks[-1][0], ps, chunk_pages)
        for number, (chunk, tokens) in enumerate(chunks):
            begin = number * chunk_pages * ps
            k, v = (read_pages(kv_pages, chunk, tokens) for kv_pages in pages)
            for index, (r0, r1) in enumerate(blocks):
                seen = min(tokens, r0 - begin)
                if seen > 0:
                    rows = query[:, r0 - cached : r1 - cached].contiguous()
                    part = attend_block(rows, k[:, :seen], v[:, :seen], scale, causal=False)
                    states[index] = merge_states(*states[index], *part)
        return torch.cat([state.transpose(0, 1) for state, _ in states])

    @staticmethod
    def _diagonal(query, k_pool, v_pool, table, cached, blocks, ps, scale) -> list:
        """Each block's causal state over its own keys (the new tokens' K and V
        were written to the pool before attention); full pages in one call."""
        k, v = new_keys(k_pool, v_pool, table, cached, blocks[-1][1], ps)
        states: list = [None] * len(blocks)
        full = [i for i, (r0, r1) in enumerate(blocks) if r1 - r0 == ps]
        if len(full) > 1:  # consecutive blocks: rows [a, b) of the new tokens
            a, b = blocks[full[0]][0] - cached, blocks[full[-1]][1] - cached
            n = len(full)
            outs, lses = attend_blocks(
                query[:, a:b].unflatten(1, (n, ps)).transpose(0, 1).contiguous(),
                k[:, a:b].unflatten(1, (n, ps)).transpose(0, 1).contiguous(),
                v[:, a:b].unflatten(1, (n, ps)).transpose(0, 1).contiguous(),
                scale,
            )
            for j, index in enumerate(full):
                states[index] = (outs[j], lses[j])
        for index, (r0, r1) in enumerate(blocks):
            if states[index] is None:
                rows = slice(r0 - cached, r1 - cached)
                states[index] = attend_block(
                    query[:, rows].contiguous(), k[:, rows], v[:, rows], scale, causal=r1 - r0 > 1
                )
        return states
