"""One rank's share of an MLA-family decoder (GLM-5, DeepSeek-V3.2, V3).

Same interface as `DecoderShard` (the engine, CP split and speculative
decoding drive both alike): `forward(ForwardBatch)` returns the last stage's
logits, `keep_hidden` / `last_hidden` serve the MTP draft.

Per layer: the latent row of every new token (normed compressed KV ++
post-RoPE shared key) and, where the layer's indexer runs, its indexer key
are written into the `LatentKVPool`; the indexer selects each query's top-k
from keys read back from the pool, and attention reads only the pool's
latent rows (`mla_attention`). Layers whose indexer is "shared" reuse the
previous full layer's selection of this forward.

TP: every rank computes the same latent rows, indexer keys and top-k (the
latent head is replicated); query heads, kv_b_proj, o_proj and expert columns
are split, and o_proj / MLP outputs are all-reduced. PP: the hidden states go
to the next stage, with the top-k selection when that stage's first layer
is a shared one. CP: a rank computes its zig-zag share of the new tokens; the
latent rows and indexer keys of all new tokens are all-gathered and written
by every rank, so each query's indexer scores every earlier token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvrelay.model.comm import Comm, LocalComm
from kvrelay.model.decoder import ForwardBatch, rms_norm
from kvrelay.model.dsa_indexer import index_keys, index_queries, select_topk
from kvrelay.model.latent_pool import LatentKVPool
from kvrelay.model.mla_attention import mla_attend
from kvrelay.model.mla_config import MlaConfig
from kvrelay.model.mla_rope import rotate
from kvrelay.model.mla_weights import MlaLayerWeights, MlaModelWeights, MlaShardPlan
from kvrelay.model.moe import mlp, moe_forward
from kvrelay.model.rope import RotaryEmbedding

# transformers' q_a_layernorm and kv_a_layernorm keep the RMSNorm default eps.
LATENT_NORM_EPS = 1e-6


class MlaDecoderShard:
    def __init__(
        self,
        config: MlaConfig,
        plan: MlaShardPlan,
        weights: MlaModelWeights,
        pool: LatentKVPool,
        comm: Comm | None = None,
    ) -> None:
        if pool.num_layers != len(weights.layers):
            raise ValueError("the pool's layers must be the shard's")
        self.config = config
        self.plan = plan
        self.weights = weights
        self.pool = pool
        self.comm = comm or LocalComm()
        self.rope = RotaryEmbedding(config)
        self.dtype = pool.dtype
        self.scale = config.softmax_scale
        self.keep_hidden = False
        self.last_hidden: torch.Tensor | None = None
        kinds = config.indexer_types
        # PP: a stage whose first layer reuses a top-k receives it from the
        # stage before, which then sends it.
        self.receives_topk = bool(kinds) and kinds[plan.layer_start] == "shared"
        self.sends_topk = (
            bool(kinds) and plan.layer_end < config.num_layers and kinds[plan.layer_end] == "shared"
        )

    def forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        w, rows = self.weights, batch.token_ids.numel()
        topk = None
        if self.comm.first_stage:
            hidden = F.embedding(batch.token_ids, w.embed)
        else:
            like = torch.empty(
                rows, self.config.hidden_size, dtype=self.dtype, device=self.pool.device
            )
            hidden = self.comm.recv_prev(like)
            if self.receives_topk:
                like = torch.empty(
                    rows, self.config.index_topk, dtype=torch.int64, device=self.pool.device
                )
                topk = self.comm.recv_prev(like)
        cos, sin = self.rope.cos_sin(batch.positions, self.dtype)
        for index, layer in enumerate(w.layers):
            hidden, topk = self.layer(index, layer, hidden, cos, sin, batch, topk)
        if not self.comm.last_stage:
            self.comm.send_next(hidden)
            if self.sends_topk:
                self.comm.send_next(topk)
            return None
        if batch.split is not None:
            hidden = batch.split.all_gather(hidden)
        eps = self.config.rms_norm_eps
        if self.keep_hidden:
            hidden = self.last_hidden = rms_norm(hidden, w.final_norm, eps)
        if batch.last_rows is not None:
            hidden = hidden[batch.last_rows]
        if not self.keep_hidden:
            hidden = rms_norm(hidden, w.final_norm, eps)
        return F.linear(hidden, w.lm_head)

    def layer(self, index: int, w: MlaLayerWeights, hidden, cos, sin, batch: ForwardBatch, topk):
        """Local layer `index` over the batch's rows; returns (hidden, top-k
        selection for a following shared layer)."""
        c, heads = self.config, self.plan.num_q_heads
        x = rms_norm(hidden, w.input_norm, c.rms_norm_eps)
        rows = x.size(0)
        q_resid = None
        if w.q_a_proj is None:
            q = F.linear(x, w.q_proj)
        else:
            q_resid = rms_norm(F.linear(x, w.q_a_proj, w.q_a_bias), w.q_a_norm, LATENT_NORM_EPS)
            q = F.linear(q_resid, w.q_proj)
        q = q.view(rows, heads, c.qk_head_dim)
        q_nope = q[..., : c.qk_nope_head_dim]
        q_rot = rotate(q[..., c.qk_nope_head_dim :], cos, sin, c.rope_interleave)
        compressed = F.linear(x, w.kv_a_proj, w.kv_a_bias)
        kv = rms_norm(compressed[:, : c.kv_lora_rank], w.kv_a_norm, LATENT_NORM_EPS)
        k_rot = rotate(compressed[:, None, c.kv_lora_rank :], cos, sin, c.rope_interleave)[:, 0]
        latent = torch.cat([kv, k_rot], dim=-1)
        keys = None if w.indexer is None else index_keys(x, w.indexer, cos, sin, c)
        if batch.split is not None:  # every CP rank holds every new token's rows
            latent = batch.split.all_gather(latent)
            keys = None if keys is None else batch.split.all_gather(keys)
        pool = self.pool
        pool.latent_layers[index][batch.write_slots] = latent
        if w.indexer is not None:
            pool.index_keys[index][batch.write_slots] = keys.to(pool.index_dtype)
            q_index, head_weights = index_queries(q_resid, x, w.indexer, cos, sin, c)
            topk = select_topk(q_index, head_weights, pool.index_keys[index], batch.attention, c)
        attn = mla_attend(
            q_nope, q_rot, pool.latent_layers[index], w.w_uk, w.w_uv, batch.attention,
            self.scale, topk if c.has_indexer else None,
        )  # fmt: skip
        out = F.linear(attn.reshape(rows, heads * c.v_head_dim), w.o_proj)
        self.comm.all_reduce_tp(out)
        if w.o_bias is not None:
            out = out + w.o_bias
        hidden = hidden + out
        x = rms_norm(hidden, w.post_norm, c.rms_norm_eps)
        out = mlp(x, *w.dense) if w.dense is not None else moe_forward(x, w.moe, c)
        self.comm.all_reduce_tp(out)
        return hidden + out, topk
