"""One rank's share of a Llama/Qwen2 decoder: the forward pass over a batch.

The math follows the Hugging Face definitions, including their numerics
where they fix a precision: RMSNorm statistics in float32 and RoPE tables in
float32, whatever the model dtype. Under TP a rank holds a slice of query and
KV heads and of the MLP columns; o_proj and down_proj outputs are partial
sums, all-reduced before their bias. Under PP a rank holds a run of layers;
the first stage embeds tokens, the last applies the final norm and LM head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvrelay.model.attention import AttentionBackend, AttentionBatch
from kvrelay.model.comm import Comm, LocalComm
from kvrelay.model.config import ModelConfig
from kvrelay.model.paged_attention import PagedOnlineSoftmaxBackend
from kvrelay.model.pool import PagedKVPool
from kvrelay.model.rope import RotaryEmbedding, apply_rotary
from kvrelay.model.weights import LayerWeights, ModelWeights, ShardPlan

if TYPE_CHECKING:
    from kvrelay.model.context_parallel import ContextSplit


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """The new tokens of a batch of sequences, flattened.

    `token_ids`, `positions` and `write_slots` have one entry per new token;
    `attention` says where each sequence's queries and context are;
    `last_rows` are the rows whose logits are wanted (or None for all rows).
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    write_slots: torch.Tensor
    attention: AttentionBatch
    last_rows: torch.Tensor | None
    # Context parallelism: this rank's rows are a share of the batch's new
    # tokens; K/V and the last stage's hidden states are all-gathered
    # (`kvrelay.model.context_parallel`). write_slots and last_rows then
    # index the whole batch.
    split: ContextSplit | None = None

    @classmethod
    def build(cls, pool: PagedKVPool, spans, all_rows: bool) -> ForwardBatch:
        """The batch of positions [begin, end) of each span's sequence, whose
        KV lives in `pages` of `pool`. spans: (pages, token ids of the span,
        begin, end). Built on the CPU, then moved to the pool's device in one
        place; `all_rows` False keeps only each span's last row's logits."""
        ps = pool.page_size
        token_ids, positions, slots, starts, lens, contexts, tables, last = ([] for _ in range(8))
        row = 0
        for pages, span_tokens, begin, end in spans:
            token_ids.extend(span_tokens)
            positions.append(torch.arange(begin, end, dtype=torch.int64))
            slots.append(pool.slots(pages, end, start=begin))
            starts.append(row)
            lens.append(end - begin)
            contexts.append(end)
            tables.append(torch.as_tensor(pages[: -(-end // ps)], dtype=torch.int64))
            row += end - begin
            last.append(row - 1)
        dev = pool.device
        return cls(
            token_ids=torch.tensor(token_ids, dtype=torch.int64).to(dev),
            positions=torch.cat(positions).to(dev),
            write_slots=torch.cat(slots).to(dev),
            attention=AttentionBatch(
                tuple(starts),
                tuple(lens),
                tuple(contexts),
                tuple(t.to(dev) for t in tables),
                page_size=ps,
            ),
            last_rows=None if all_rows else torch.tensor(last, dtype=torch.int64).to(dev),
        )


class DecoderShard:
    def __init__(
        self,
        config: ModelConfig,
        plan: ShardPlan,
        weights: ModelWeights,
        pool: PagedKVPool,
        comm: Comm | None = None,
        backend: AttentionBackend | None = None,
    ) -> None:
        if pool.num_layers != len(weights.layers) or pool.num_heads != plan.num_kv_heads:
            raise ValueError("the pool's layers and heads must be the shard's")
        self.config = config
        self.plan = plan
        self.weights = weights
        self.pool = pool
        self.comm = comm or LocalComm()
        self.backend = backend or PagedOnlineSoftmaxBackend()
        self.rope = RotaryEmbedding(config)
        self.dtype = pool.dtype
        self.scale = config.head_dim**-0.5
        # A draft (MTP) layer needs the final-normed hidden state of every row
        # (last stage only); off, only `last_rows` are normed.
        self.keep_hidden = False
        self.last_hidden: torch.Tensor | None = None

    def forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Runs this rank's layers; returns logits of `batch.last_rows` on the
        last stage (float, [rows, vocab]) and None elsewhere."""
        w = self.weights
        if self.comm.first_stage:
            hidden = F.embedding(batch.token_ids, w.embed)
        else:
            like = torch.empty(
                batch.token_ids.numel(),
                self.config.hidden_size,
                dtype=self.dtype,
                device=self.pool.device,
            )
            hidden = self.comm.recv_prev(like)
        cos, sin = self.rope.cos_sin(batch.positions, self.dtype)
        for index, layer in enumerate(w.layers):
            hidden = self._layer(index, layer, hidden, cos, sin, batch)
        if not self.comm.last_stage:
            self.comm.send_next(hidden)
            return None
        if batch.split is not None:
            hidden = batch.split.all_gather(hidden)
        if self.keep_hidden:
            hidden = self.last_hidden = rms_norm(hidden, w.final_norm, self.config.rms_norm_eps)
        if batch.last_rows is not None:
            hidden = hidden[batch.last_rows]
        if not self.keep_hidden:
            hidden = rms_norm(hidden, w.final_norm, self.config.rms_norm_eps)
        return F.linear(hidden, w.lm_head)

    def _layer(self, index, layer: LayerWeights, hidden, cos, sin, batch: ForwardBatch):
        plan, hd, eps = self.plan, self.config.head_dim, self.config.rms_norm_eps
        x = rms_norm(hidden, layer.input_norm, eps)
        tokens = x.size(0)
        q = F.linear(x, layer.q_proj, layer.q_bias).view(tokens, plan.num_q_heads, hd)
        k = F.linear(x, layer.k_proj, layer.k_bias).view(tokens, plan.num_kv_heads, hd)
        v = F.linear(x, layer.v_proj, layer.v_bias).view(tokens, plan.num_kv_heads, hd)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        if batch.split is not None:  # every CP rank holds the K/V of every new token
            k, v = batch.split.all_gather(k), batch.split.all_gather(v)
        k_pool, v_pool = self.pool.k_layers[index], self.pool.v_layers[index]
        # The pool holds post-RoPE K, as HF's cache and every paged engine do.
        k_pool[batch.write_slots] = k
        v_pool[batch.write_slots] = v
        attn = self.backend.attend(q, k_pool, v_pool, batch.attention, self.scale)
        out = F.linear(attn.reshape(tokens, plan.num_q_heads * hd), layer.o_proj)
        self.comm.all_reduce_tp(out)
        if layer.o_bias is not None:
            out = out + layer.o_bias
        hidden = hidden + out
        x = rms_norm(hidden, layer.post_norm, eps)
        gate = F.linear(x, layer.gate_proj, layer.gate_bias)
        up = F.linear(x, layer.up_proj, layer.up_bias)
        out = F.linear(F.silu(gate) * up, layer.down_proj)
        self.comm.all_reduce_tp(out)
        if layer.down_bias is not None:
            out = out + layer.down_bias
        return hidden + out
