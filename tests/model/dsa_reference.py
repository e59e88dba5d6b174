"""The DSA indexer's selection and MLA sparse attention as first written: a
block's scores through [rows, heads, keys] temporaries, torch.topk over every
row with a per-row tie fix, the selected latent rows indexed by pool slot.
The fast paths must equal them bit for bit."""

from __future__ import annotations

import torch

from kvrelay.model import dsa_indexer, mla_attention
from kvrelay.model.dsa_indexer import context_rows


def select_topk(q, weights, key_layer, attention, index_topk: int, index_head_dim: int):
    topk, ps = index_topk, attention.page_size
    scale = index_head_dim**-0.5
    out = torch.full((q.size(0), topk), -1, dtype=torch.int64)
    for start, length, context, table in attention.sequences():
        keys = context_rows(key_layer, table, context, ps).float().T[None, None]
        cached = context - length
        block = max(1, dsa_indexer.SCORE_BLOCK_ELEMENTS // (q.size(1) * context))
        for r0 in range(0, length, block):
            r1 = min(length, r0 + block)
            rows = slice(start + r0, start + r1)
            seen = cached + r1
            summed = _scores(q[rows], weights[rows], keys[..., :seen], scale)
            position = cached + torch.arange(r0, r1)
            visible = torch.arange(seen)[None, :] <= position[:, None]
            summed = summed.masked_fill(~visible, float("-inf"))
            out[rows, : min(topk, seen)] = top(summed, min(topk, seen))
    return out


def _scores(q, weights, keys, scale: float) -> torch.Tensor:
    if q.dtype == torch.float64:
        dots = torch.matmul(q.float().double()[None], keys.double()).float()
        scores = dots.mul_(scale).relu_()
        summed = torch.matmul(weights.double()[None].unsqueeze(-2), scores.double())
        return summed.squeeze(-2)[0].float()
    scores = torch.matmul(q.float()[None], keys).mul_(scale).relu_()
    return torch.matmul(weights[None].unsqueeze(-2), scores).squeeze(-2)[0]


def top(summed: torch.Tensor, k: int) -> torch.Tensor:
    values, indices = summed.topk(k, dim=-1)
    kth = values[:, -1:]
    tied = (summed == kth).sum(-1) > (values == kth).sum(-1)
    tied &= torch.isfinite(kth[:, 0])
    for row in tied.nonzero().flatten().tolist():
        above = (summed[row] > kth[row]).nonzero().flatten()
        at = (summed[row] == kth[row]).nonzero().flatten()[: k - above.numel()]
        indices[row] = torch.cat([above, at])
    return indices


def sparse_attend(q_nope, q_rot, latent_layer, w_uk, w_uv, attention, scale, topk):
    """mla_attend's sparse path (every sequence's context above index_topk)."""
    out = q_nope.new_empty(q_nope.size(0), w_uk.size(0), w_uv.size(1))
    for start, length, context, table in attention.sequences():
        assert context > topk.size(1)
        rows = slice(start, start + length)
        pages = (latent_layer, table, attention.page_size)
        q = (q_nope[rows], q_rot[rows])
        out[rows] = _sparse(q, pages, w_uk, w_uv, topk[rows], context - length, scale)
    return out


def _sparse(q, pages, w_uk, w_uv, topk, cached: int, scale: float) -> torch.Tensor:
    latent_layer, table, ps = pages
    q_nope, q_rot = q
    rank = w_uk.size(2)
    length, k = topk.shape
    out = q_nope.new_empty(length, w_uk.size(0), w_uv.size(1))
    width = max(w_uk.size(0), latent_layer.size(1))
    block = max(1, mla_attention.SCORE_BLOCK_ELEMENTS // (k * width))
    for r0 in range(0, length, block):
        r1 = min(length, r0 + block)
        chosen = topk[r0:r1]
        position = cached + torch.arange(r0, r1)
        valid = (chosen >= 0) & (chosen <= position[:, None])
        tokens = chosen.clamp(min=0)
        selected = latent_layer[table[tokens // ps] * ps + tokens % ps].to(w_uk.dtype)
        c, k_rot = selected[..., :rank], selected[..., rank:]
        q_lat = torch.matmul(q_nope[r0:r1].transpose(0, 1), w_uk).transpose(0, 1)
        scores = torch.matmul(q_lat, c.transpose(1, 2))
        scores = (scores + torch.matmul(q_rot[r0:r1], k_rot.transpose(1, 2))) * scale
        probs = torch.softmax(scores.masked_fill(~valid[:, None, :], float("-inf")), dim=-1)
        o_lat = torch.matmul(probs, c)
        out[r0:r1] = torch.matmul(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
    return out
