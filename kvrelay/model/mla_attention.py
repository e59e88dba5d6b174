"""Multi-head latent attention over a pool of latent rows.

A latent row is c_t ++ k_rot_t: the normed compressed KV (kv_lora_rank) and
the shared post-RoPE key. Head h's key is [W_UK[h] c_t, k_rot_t] and its
value W_UV[h] c_t (W_UK, W_UV: kv_b_proj's rows of that head). Attention
reads each sequence's latent rows from the pool's pages and nothing else, so
a prefix whose pages came from another worker attends the same.

Two exact ways to compute it, picked per sequence by arithmetic cost:
- expanded: K and V of every context token through kv_b_proj, then ordinary
  attention (cheap when many queries share a context: prefill);
- absorbed: q_nope folded into W_UK (q_lat = W_UK[h]^T q_nope), scores
  against the latent rows directly, the weighted latent sum then through
  W_UV (cheap for a few queries over a long context: decode). Both are the
  same sums in another order; in float64 they agree with transformers to
  rounding.

With DSA a query attends only to the tokens its indexer selected
(`dsa_indexer.select_topk`), always within the causal window.
"""

from __future__ import annotations

import torch

from kvrelay.model.attention import AttentionBatch
from kvrelay.model.dsa_indexer import context_rows, selection_mask
from kvrelay.model.paged_attention import accumulation_dtype

# Score elements per block of queries ([heads, rows, context]).
SCORE_BLOCK_ELEMENTS = 1 << 24


def absorbed_is_cheaper(queries: int, context: int, heads: int, nope: int, rank: int, v: int):
    """Multiply-adds of the two forms for one sequence; rope terms are common."""
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
    rank]; topk the indexer's selection or None (dense causal). Returns
    [rows, heads, v] in q's dtype."""
    acc = accumulation_dtype(q_nope.dtype)
    heads, nope, rank = w_uk.shape
    v_dim = w_uv.size(1)
    out = q_nope.new_empty(q_nope.size(0), heads, v_dim)
    w_uk, w_uv = w_uk.to(acc), w_uv.to(acc)
    for start, length, context, table in attention.sequences():
        latent = context_rows(latent_layer, table, context, attention.page_size).to(acc)
        c, k_rot = latent[:, :rank], latent[:, rank:]
        absorbed = absorbed_is_cheaper(length, context, heads, nope, rank, v_dim)
        if not absorbed:
            k_nope = torch.matmul(c, w_uk.transpose(1, 2))  # [heads, context, nope]
            values = torch.matmul(c, w_uv.transpose(1, 2))  # [heads, context, v]
        block = max(1, SCORE_BLOCK_ELEMENTS // (heads * context))
        for r0 in range(0, length, block):
            r1 = min(length, r0 + block)
            rows = slice(start + r0, start + r1)
            qn = q_nope[rows].to(acc).transpose(0, 1)  # [heads, L, nope]
            qr = q_rot[rows].to(acc).transpose(0, 1)
            if absorbed:
                scores = torch.matmul(torch.matmul(qn, w_uk), c.T)
            else:
                scores = torch.matmul(qn, k_nope.transpose(1, 2))
            scores = (scores + torch.matmul(qr, k_rot.T)) * scale
            position = context - length + torch.arange(r0, r1, device=scores.device)
            visible = torch.arange(context, device=scores.device)[None, :] <= position[:, None]
            if topk is not None:
                visible = visible & selection_mask(topk, rows, context)
            scores = scores.masked_fill(~visible, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            if absorbed:
                result = torch.matmul(torch.matmul(probs, c), w_uv.transpose(1, 2))
            else:
                result = torch.matmul(probs, values)
            out[rows] = result.transpose(0, 1).to(out.dtype)
    return out
