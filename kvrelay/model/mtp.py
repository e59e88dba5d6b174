"""The MTP draft layer, DeepSeek-V3 / GLM style.

    x      = eh_proj(cat(enorm(embed(t[i+1])), hnorm(h_i)))
    x      = one decoder layer of the target's architecture (its own attention,
             its own paged KV: the draft pool, one layer deep)
    g_i    = shared_head.norm(x)
    logits = lm_head(g_i)          (the target's embedding and LM head, shared)

`h_i` is the target's last hidden state at position i after its final norm
(what SGLang and vLLM hand their MTP layers); a chained draft step feeds the
layer's own `g_i` instead. The weights are read as DeepSeek-V3 stores them:
`num_nextn_predict_layers: 1` in config.json and the tensors under
`model.layers.{num_hidden_layers}.*` (`enorm`, `hnorm`, `eh_proj`, the decoder
layer's usual tensors, `shared_head.norm`); DeepSeek's copies of the shared
embedding and head (`embed_tokens`, `shared_head.head`) are not read.

Position convention: draft slot i (computed from h_i and token i + 1) is
rotated at position i, the target position of h_i, as SGLang and vLLM do
("target"); transformers' generic MtpModel uses i + 1 ("shifted"). Both are
implemented; the convention is part of the draft's namespace because it
changes the bytes of the draft's K.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from kvrelay.layout import DRAFT_POSITION_CONVENTIONS, ModelKVSpec
from kvrelay.model.comm import Comm
from kvrelay.model.config import ModelConfig
from kvrelay.model.decoder import DecoderShard, ForwardBatch, rms_norm
from kvrelay.model.errors import ModelLoadError
from kvrelay.model.pool import PagedKVPool
from kvrelay.model.weights import LayerWeights, ModelWeights, ShardPlan, _Reader, read_layer


@dataclass(slots=True)
class MtpWeights:
    enorm: torch.Tensor
    hnorm: torch.Tensor
    eh_proj: torch.Tensor  # [hidden, 2 * hidden], replicated over TP
    layer: LayerWeights  # this rank's heads and MLP columns
    head_norm: torch.Tensor  # shared_head.norm
    embed: torch.Tensor
    lm_head: torch.Tensor


def mtp_prefix(config: ModelConfig) -> str:
    return f"model.layers.{config.num_layers}."


def load_mtp_weights(
    model_dir: str | Path,
    config: ModelConfig,
    plan: ShardPlan,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> MtpWeights:
    """The MTP layer's tensors for `plan`'s rank (its TP share of the decoder layer)."""
    if config.num_mtp_layers < 1:
        raise ModelLoadError(
            f"{model_dir}: the model has no MTP layer (num_nextn_predict_layers in config.json)"
        )
    reader = _Reader(model_dir, dtype, device)
    hidden, p = config.hidden_size, mtp_prefix(config)
    embed = reader.read("model.embed_tokens.weight", (config.vocab_size, hidden))
    if config.tie_word_embeddings:
        lm_head = embed
    else:
        lm_head = reader.read("lm_head.weight", (config.vocab_size, hidden))
    return MtpWeights(
        enorm=reader.read(p + "enorm.weight", (hidden,)),
        hnorm=reader.read(p + "hnorm.weight", (hidden,)),
        eh_proj=reader.read(p + "eh_proj.weight", (hidden, 2 * hidden)),
        layer=read_layer(reader, config, plan, config.num_layers),
        head_norm=reader.read(p + "shared_head.norm.weight", (hidden,)),
        embed=embed,
        lm_head=lm_head,
    )


def draft_kv_spec(target: ModelKVSpec, config: ModelConfig, positions: str) -> ModelKVSpec:
    """The draft pages' spec: one layer of the target's KV geometry, in a
    namespace derived from the target's and the position convention."""
    return target.draft_spec(
        model_id=f"{target.model_id}:mtp0",
        weights_fingerprint=target.weights_fingerprint,
        num_layers=1,
        num_kv_heads=config.num_kv_heads,
        k_head_dim=config.head_dim,
        v_head_dim=config.head_dim,
        positions=positions,
    )


class MtpLayer:
    """One rank's share of the MTP layer over its draft pool."""

    def __init__(
        self,
        config: ModelConfig,
        plan: ShardPlan,
        weights: MtpWeights,
        pool: PagedKVPool,
        comm: Comm | None = None,
        positions: str = "target",
    ) -> None:
        if positions not in DRAFT_POSITION_CONVENTIONS:
            raise ModelLoadError(f"MTP positions must be one of {DRAFT_POSITION_CONVENTIONS}")
        self.config = config
        self.weights = weights
        self.positions = positions
        # The decoder layer is the target's own code over a one-layer pool.
        block_plan = replace(plan, layer_start=0, layer_end=1)
        block_weights = ModelWeights(weights.embed, [weights.layer], None, None)
        self.block = DecoderShard(config, block_plan, block_weights, pool, comm)
        self.pool = pool

    def forward(
        self, previous_hidden: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`batch.token_ids` are the tokens t[i+1], `batch.positions` the slots i,
        `previous_hidden` the h_i (or a chained g). Returns (g, logits) of
        `batch.last_rows` (every row when None)."""
        w, eps = self.weights, self.config.rms_norm_eps
        embedded = F.embedding(batch.token_ids, w.embed)
        joined = torch.cat(
            [rms_norm(embedded, w.enorm, eps), rms_norm(previous_hidden, w.hnorm, eps)], -1
        )
        x = F.linear(joined, w.eh_proj)
        positions = batch.positions + 1 if self.positions == "shifted" else batch.positions
        cos, sin = self.block.rope.cos_sin(positions, x.dtype)
        x = self.block._layer(0, w.layer, x, cos, sin, batch)
        if batch.last_rows is not None:
            x = x[batch.last_rows]
        g = rms_norm(x, w.head_norm, eps)
        return g, F.linear(g, w.lm_head)
