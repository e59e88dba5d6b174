"""Multi-head latent attention over a pool of latent rows.

A latent row is c_t ++ k_rot_t: the normed compressed KV (kv_lora_rank) and
the shared post-RoPE key. Head h's key is [W_UK[h] c_t, k_rot_t] and its
value W_UV[h] c_t (W_UK, W_UV: kv_b_proj's rows of that head). Attention
reads each sequence's latent rows from the pool's pages and nothing else, so
a prefix whose pages came from another worker attends the same.

Three exact ways to compute it (the same sums in another order; in float64
they agree with transformers to rounding):
- expanded: K and V of every context token through kv_b_proj, then ordinary
  causal attention (cheap when many queries share a context: prefill);
- absorbed: q_nope folded into W_UK (q_lat = W_UK[h]^T q_nope), scores
  against the latent rows directly, the weighted latent sum then through
  W_UV (cheap for a few queries over a long context: decode);
- sparse (DSA, context longer than index_topk): each query gathers only the
  latent rows its indexer selected and attends to them in the absorbed
  form, so its cost does not grow with the context.
"""

from __future__ import annotations

import torch

from kvrelay.model.attention import AttentionBatch
from kvrelay.model.dsa_indexer import context_rows
from kvrelay.model.paged_attention import accumulation_dtype

# Score (or gathered-row) elements per block of queries, and the most
# elements expanded K and V of one context may take before the absorbed form
# is used instead: they bound memory whatever the context length. Sparse
# attention gathers its selected rows this many elements at a time (a few
# queries' worth: they stay in the cache while three products read them).
SCORE_BLOCK_ELEMENTS = 1 << 24
EXPANDED_ELEMENTS = 1 << 26
GATHER_ELEMENTS = 1 << 18


def absorbed_is_cheaper(queries: int, context: int, heads: int, nope: int, rank: int, v: int):
    """Multiply-adds of the two dense forms for one sequence (rope terms are
    common), or the absorbed form when the expanded K/V would not fit."""
    if heads * context * (nope + v) > EXPANDED_ELEMENTS:
        return True
    expanded = context * rank * (nope + v) + queries * context * (nope + v)
    absorbed = queries * rank * (nope + v) + 2 * queries * context * rank
    return absorbed < expanded


def mla_attend(
    q_nope: torch.Tensor,
    q_rot: torch.Tensor,
    latent_layer: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    attention: AttentionBatch,
    scale: float,
    topk: torch.Tensor | None = None,
) -> torch.Tensor:
    """q_nope [rows, heads, nope], q_rot [rows, heads, rope]; latent_layer one
    pool layer [slots, rank + rope]; w_uk [heads, nope, rank], w_uv [heads, v,
    rank]; topk the indexer's selection [rows, index_topk] (-1 pads) or None
    (dense causal). Returns [rows, heads, v] in q's dtype."""
    acc = accumulation_dtype(q_nope.dtype)
    out = q_nope.new_empty(q_nope.size(0), w_uk.size(0), w_uv.size(1))
    w_uk, w_uv = w_uk.to(acc), w_uv.to(acc)
    ps = attention.page_size
    for start, length, context, table in attention.sequences():
        rows = slice(start, start + length)
        q = (q_nope[rows].to(acc), q_rot[rows].to(acc))
        # A query with at most index_topk visible tokens sees them all.
        if topk is not None and context > topk.size(1):
            gather = _token_rows(latent_layer, table, context, ps, acc, length * topk.size(1))
            result = _sparse(q, gather, w_uk, w_uv, topk[rows], context - length, scale)
        else:
            latent = context_rows(latent_layer, table, context, ps).to(acc)
            result = _dense(q, latent, w_uk, w_uv, context - length, scale)
        out[rows] = result.to(out.dtype)
    return out


def _token_rows(layer, table, context: int, page_size: int, dtype, selections: int):
    """tokens -> their latent rows [tokens, rank + rope] in `dtype`. A prefill
    chunk selecting more rows than its context holds copies the context once
    and gathers from it; decode rows gather by pool slot."""
    if selections >= context:
        latent = context_rows(layer, table, context, page_size).to(dtype)
        return lambda tokens: latent.index_select(0, tokens)

    def by_slot(tokens: torch.Tensor) -> torch.Tensor:
        slots = table[tokens // page_size] * page_size + tokens % page_size
        return layer.index_select(0, slots).to(dtype)

    return by_slot


def _causal(cached: int, r0: int, r1: int, context: int, device) -> torch.Tensor:
    position = cached + torch.arange(r0, r1, device=device)
    return torch.arange(context, device=device)[None, :] <= position[:, None]


def _dense(q, latent, w_uk, w_uv, cached: int, scale: float) -> torch.Tensor:
    """Causal attention of one sequence's rows over all its context."""
    q_nope, q_rot = q
    heads, nope, rank = w_uk.shape
    length, context = q_nope.size(0), latent.size(0)
    c, k_rot = latent[:, :rank], latent[:, rank:]
    absorbed = absorbed_is_cheaper(length, context, heads, nope, rank, w_uv.size(1))
    if not absorbed:
        k_nope = torch.matmul(c, w_uk.transpose(1, 2))  # [heads, context, nope]
        values = torch.matmul(c, w_uv.transpose(1, 2))  # [heads, context, v]
    out = q_nope.new_empty(length, heads, w_uv.size(1))
    block = max(1, SCORE_BLOCK_ELEMENTS // (heads * context))
    for r0 in range(0, length, block):
        r1 = min(length, r0 + block)
        qn = q_nope[r0:r1].transpose(0, 1)  # [heads, L, nope]
        if absorbed:
            scores = torch.matmul(torch.matmul(qn, w_uk), c.T)
        else:
            scores = torch.matmul(qn, k_nope.transpose(1, 2))
        scores = (scores + torch.matmul(q_rot[r0:r1].transpose(0, 1), k_rot.T)) * scale
        visible = _causal(cached, r0, r1, context, scores.device)
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        if absorbed:
            result = torch.matmul(torch.matmul(probs, c), w_uv.transpose(1, 2))
        else:
            result = torch.matmul(probs, values)
        out[r0:r1] = result.transpose(0, 1)
    return out


def _sparse(q, gather, w_uk, w_uv, topk, cached: int, scale: float) -> torch.Tensor:
    """Each row attends to the latent rows of its selected tokens only
    (absorbed form); selections past a row's position (a row with fewer
    visible tokens than index_topk) and -1 pads are masked. gather: tokens
    -> latent rows (`_token_rows`)."""
    q_nope, q_rot = q
    heads, rank = w_uk.size(0), w_uk.size(2)
    length, k = topk.shape
    out = q_nope.new_empty(length, heads, w_uv.size(1))
    # A block's q_lat and output projections are products with a block's
    # rows as M: their rounding depends on M, so blocks stay this size.
    width = rank + q_rot.size(-1)
    block = max(1, SCORE_BLOCK_ELEMENTS // (k * max(heads, width)))
    sub = max(1, GATHER_ELEMENTS // (k * width))
    for r0 in range(0, length, block):
        r1 = min(length, r0 + block)
        q_lat = torch.matmul(q_nope[r0:r1].transpose(0, 1), w_uk).transpose(0, 1)  # [L, h, r]
        o_lat = q_lat.new_empty(r1 - r0, heads, rank)
        for s0 in range(r0, r1, sub):
            s1 = min(r1, s0 + sub)
            o_lat[s0 - r0 : s1 - r0] = _attend_selected(
                q_lat[s0 - r0 : s1 - r0], q_rot[s0:s1], gather, topk[s0:s1], cached + s0, scale
            )
        out[r0:r1] = torch.matmul(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
    return out


def _attend_selected(q_lat, q_rot, gather, chosen, first: int, scale: float) -> torch.Tensor:
    """[rows, heads, rank] latent outputs of rows at positions first.. over
    their selected tokens (index_select copies whole rows, where indexing a
    tensor by a 2D index costs a pass per element)."""
    rows, k = chosen.shape
    rank = q_lat.size(-1)
    position = first + torch.arange(rows, device=chosen.device)
    valid = (chosen >= 0) & (chosen <= position[:, None])
    selected = gather(chosen.clamp(min=0).flatten()).view(rows, k, -1)
    c, k_rot = selected[..., :rank], selected[..., rank:]
    scores = torch.matmul(q_lat, c.transpose(1, 2))  # [rows, heads, k]
    scores = (scores + torch.matmul(q_rot, k_rot.transpose(1, 2))) * scale
    probs = torch.softmax(scores.masked_fill(~valid[:, None, :], float("-inf")), dim=-1)
    return torch.matmul(probs, c)
