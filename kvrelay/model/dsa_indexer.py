"""The DeepSeek sparse attention (DSA) indexer: per query, the top-k earlier
tokens an MLA layer attends to.

Per new token the indexer writes one key (`k_norm(wk(x))`, RoPE on its
first `qk_rope_head_dim` dims; GLM-5 rotates interleaved, V3.2 half-split)
into the pool in the model dtype, as transformers' cache holds it. A query
scores every visible token of its sequence, reading those keys from the
pool's pages only (prefix pages may come from another worker):

    score[t] = sum_h w_h * relu(q_h . k_t * D^-0.5),   w = weights_proj(x) * H^-0.5

in float32 whatever the model dtype, by transformers' operations in its
order (a batched matmul over queries, then the head-weighted sum), so the
top-k is the one transformers picks. float32 rounding depends on a call's
shapes (how many queries and keys it holds), so two scores equal to float32
rounding may rank differently between a chunked and a whole prefill; a
float64 model therefore sums in float64 and rounds once (`_exact_scores`),
which makes its selection independent of how a forward is cut, and exact
ties go to the earliest tokens (`kvrelay.model.dsa_topk`). A query with at
most `index_topk` visible tokens sees them all.

The selection is returned as token indices `[rows, index_topk]` (-1 pads):
a fixed shape, so a PP stage can hand it to the next one when that stage
starts with a layer that reuses it ("shared" layers of GLM-5).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvrelay.model.attention import AttentionBatch
from kvrelay.model.dsa_topk import top_k
from kvrelay.model.mla_config import MlaConfig
from kvrelay.model.mla_rope import rotate
from kvrelay.model.mla_weights import IndexerWeights

# Score elements per block of queries ([rows, heads, context] float32). The
# block also fixes each row's length (its keys up to the block's last row),
# and torch.topk orders tied scores by the whole row: the selection's order
# stays the same only while this does.
SCORE_BLOCK_ELEMENTS = 1 << 24
# A float64 model scores a tile of (query head, key) pairs at a time, at most
# this many query heads by as many keys as make the tile's elements: a tile
# stays in the cache across the passes that round, scale, relu and weigh it.
SCORE_GROUP_WIDTH = 64
SCORE_TILE_ELEMENTS = 1 << 18


def context_rows(layer: torch.Tensor, table: torch.Tensor, tokens: int, page_size: int):
    """Rows [0, tokens) of a sequence from one pool layer [slots, width]."""
    pages = -(-tokens // page_size)
    paged = layer.view(-1, page_size, layer.size(-1))
    return paged.index_select(0, table[:pages]).flatten(0, 1)[:tokens]


def _split_rope(x: torch.Tensor, rope: int, cos, sin, interleaved: bool) -> torch.Tensor:
    """RoPE on the first `rope` dims of [tokens, heads, dim] (rot first, then pass)."""
    return torch.cat([rotate(x[..., :rope], cos, sin, interleaved), x[..., rope:]], dim=-1)


def index_keys(x, w: IndexerWeights, cos, sin, config: MlaConfig) -> torch.Tensor:
    """[tokens, index_head_dim] keys of the new tokens, in the model dtype."""
    d = config.index_head_dim
    k = F.layer_norm(F.linear(x, w.wk), (d,), w.k_norm, w.k_norm_bias, eps=1e-6)
    rope = config.qk_rope_head_dim
    return _split_rope(k[:, None], rope, cos, sin, config.indexer_rope_interleave)[:, 0]


def index_queries(q_resid, x, w: IndexerWeights, cos, sin, config: MlaConfig):
    """(queries [tokens, heads, dim], head weights float32 [tokens, heads])."""
    tokens, heads = q_resid.size(0), config.index_n_heads
    q = F.linear(q_resid, w.wq_b).view(tokens, heads, config.index_head_dim)
    q = _split_rope(q, config.qk_rope_head_dim, cos, sin, config.indexer_rope_interleave)
    weights = F.linear(x.to(w.weights_proj.dtype), w.weights_proj).float() * heads**-0.5
    return q, weights


def select_topk(q, weights, key_layer, attention: AttentionBatch, config: MlaConfig):
    """int64 [rows, index_topk] of each query's selected token positions (-1 pads)."""
    topk, ps = config.index_topk, attention.page_size
    scale = config.index_head_dim**-0.5
    out = torch.full((q.size(0), topk), -1, dtype=torch.int64, device=q.device)
    exact = q.dtype == torch.float64
    for start, length, context, table in attention.sequences():
        # Rounded to float32 once per sequence, not per block.
        keys = context_rows(key_layer, table, context, ps).float()
        keys = keys.double() if exact else keys.T[None, None]
        cached = context - length
        block = max(1, SCORE_BLOCK_ELEMENTS // (q.size(1) * context))
        for r0 in range(0, length, block):
            r1 = min(length, r0 + block)
            rows = slice(start + r0, start + r1)
            # A block's rows see no key past its last row: a long prefill
            # chunk scores the causal triangle, not the square.
            seen = cached + r1
            if exact:
                summed = _exact_scores(q[rows], weights[rows], keys[:seen], scale)
            else:
                summed = _scores(q[rows], weights[rows], keys[..., :seen], scale)
            # Only the block's own tokens are past some row's position.
            diagonal = torch.ones(r1 - r0, r1 - r0, dtype=torch.bool, device=q.device)
            summed[:, cached + r0 :].masked_fill_(diagonal.triu_(1), float("-inf"))
            out[rows, : min(topk, seen)] = top_k(summed, min(topk, seen))
    return out


def _exact_scores(q, weights, keys, scale: float) -> torch.Tensor:
    """float32 [rows, keys] head-weighted scores of a float64 model's block
    of queries; keys [keys, dim] float64 holding float32 values.

    Dots and head sums are summed in float64 and rounded to float32 once
    each: within an ulp of transformers' float32 sums and, unlike them, the
    same whatever rows and keys a call holds, so chunked, cached and whole
    prefills select the same tokens (the top-k is discontinuous: a flipped
    near tie changes what a query attends to). Every query head is one row
    of a 2D product, a tile of keys at a time into buffers reused across
    tiles: one pass over the keys instead of a dozen over [rows, heads, keys]
    temporaries."""
    rows, heads = weights.shape
    seen = keys.size(0)
    q = q.float().double().view(rows, heads, -1)
    weights = weights.double()[:, None, :]
    group = max(1, min(rows, SCORE_GROUP_WIDTH // heads))
    tile = min(seen, max(1, SCORE_TILE_ELEMENTS // (group * heads)))
    summed = torch.empty(rows, seen, dtype=torch.float32, device=q.device)
    dots = q.new_empty(group * heads * tile)
    rounded = torch.empty(group * heads * tile, dtype=torch.float32, device=q.device)
    weighed = q.new_empty(group * tile)
    for g0 in range(0, rows, group):
        g1 = min(rows, g0 + group)
        width = (g1 - g0) * heads
        qg, wg = q[g0:g1].reshape(width, -1), weights[g0:g1, 0, :, None]
        for k0 in range(0, seen, tile):
            n = min(tile, seen - k0)
            dot = torch.mm(qg, keys[k0 : k0 + n].T, out=dots[: width * n].view(width, n))
            score = rounded[: width * n].view(width, n).copy_(dot).mul_(scale).relu_()
            score = score.view(g1 - g0, heads, n)
            acc = torch.mul(score[:, 0], wg[:, 0], out=weighed[: (g1 - g0) * n].view(-1, n))
            for h in range(1, heads):
                acc.addcmul_(score[:, h], wg[:, h])
            summed[g0:g1, k0 : k0 + n] = acc
    return summed


def _scores(q, weights, keys, scale: float) -> torch.Tensor:
    """float32 [rows, keys] head-weighted scores of a block of queries by
    transformers' float32 operations in its order."""
    # In place: the same roundings as `relu(matmul * scale)`, one buffer.
    scores = torch.matmul(q.float()[None], keys).mul_(scale).relu_()
    return torch.matmul(weights[None].unsqueeze(-2), scores).squeeze(-2)[0]
