"""The MTP draft layer of the MLA family (GLM-5, DeepSeek-V3.2, DeepSeek-V3).

The same draft as `kvrelay.model.mtp` (eh_proj over the normed embedding of
token i + 1 and the target's normed hidden state h_i, one decoder layer,
shared_head.norm, the target's LM head), with the family's decoder layer:
MLA over a one-layer `LatentKVPool` of its own (the draft pages), its own
DSA indexer and keys where the checkpoint has one (an MTP layer has no
earlier layer whose top-k it could reuse), and an MoE or dense MLP as its
tensors say. Weights are read from `model.layers.{num_hidden_layers}.*` as
DeepSeek-format checkpoints store them; transformers drops them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from kvrelay.layout import DRAFT_POSITION_CONVENTIONS, ModelKVSpec
from kvrelay.model.decoder import ForwardBatch, rms_norm
from kvrelay.model.errors import ModelLoadError
from kvrelay.model.latent_pool import LatentKVPool
from kvrelay.model.mla_config import MlaConfig
from kvrelay.model.mla_decoder import MlaDecoderShard
from kvrelay.model.mla_weights import MlaLayerWeights, MlaModelWeights, read_mla_layer
from kvrelay.model.speculative import SpecDecoder
from kvrelay.model.weights import _Reader


@dataclass(slots=True)
class MlaMtpWeights:
    enorm: torch.Tensor
    hnorm: torch.Tensor
    eh_proj: torch.Tensor  # [hidden, 2 * hidden], replicated over TP
    layer: MlaLayerWeights
    head_norm: torch.Tensor
    embed: torch.Tensor
    lm_head: torch.Tensor


def mtp_layer_kind(reader: _Reader, config: MlaConfig) -> tuple[bool, bool]:
    """(MoE MLP, indexer runs) of the MTP layer, from the tensors it has."""
    p = f"model.layers.{config.num_layers}."
    sparse = p + "mlp.gate.weight" in reader.files
    indexed = config.has_indexer and p + "self_attn.indexer.wk.weight" in reader.files
    return sparse, indexed


def load_mla_mtp_weights(model_dir, config: MlaConfig, plan, dtype, device) -> MlaMtpWeights:
    reader = _Reader(model_dir, dtype, device)
    hidden, p = config.hidden_size, f"model.layers.{config.num_layers}."
    sparse, indexed = mtp_layer_kind(reader, config)
    embed = reader.read("model.embed_tokens.weight", (config.vocab_size, hidden))
    if config.tie_word_embeddings:
        lm_head = embed
    else:
        lm_head = reader.read("lm_head.weight", (config.vocab_size, hidden))
    return MlaMtpWeights(
        enorm=reader.read(p + "enorm.weight", (hidden,)),
        hnorm=reader.read(p + "hnorm.weight", (hidden,)),
        eh_proj=reader.read(p + "eh_proj.weight", (hidden, 2 * hidden)),
        layer=read_mla_layer(reader, config, plan, config.num_layers, sparse, indexed),
        head_norm=reader.read(p + "shared_head.norm.weight", (hidden,)),
        embed=embed,
        lm_head=lm_head,
    )


def mla_draft_kv_spec(target: ModelKVSpec, config: MlaConfig, positions: str, indexed: bool):
    """The draft pages: one latent layer, with the MTP indexer's keys when it has one."""
    return target.draft_spec(
        model_id=f"{target.model_id}:mtp0",
        weights_fingerprint=target.weights_fingerprint,
        num_layers=1,
        num_kv_heads=1,
        k_head_dim=config.latent_dim,
        v_head_dim=0,
        attention_kind="mla",
        positions=positions,
        rope_head_dim=config.qk_rope_head_dim,
        index_head_dim=config.index_head_dim if indexed else 0,
        index_layers=(0,) if indexed else (),
        index_topk=config.index_topk if indexed else 0,
    )


class MlaMtpLayer:
    """One rank's share of the MTP layer over its draft pool (`MtpLayer`'s interface)."""

    def __init__(self, config: MlaConfig, plan, weights: MlaMtpWeights, pool, comm, positions):
        if positions not in DRAFT_POSITION_CONVENTIONS:
            raise ModelLoadError(f"MTP positions must be one of {DRAFT_POSITION_CONVENTIONS}")
        self.config = config
        self.weights = weights
        self.positions = positions
        self.pool = pool
        # The decoder layer is the target's own code over a one-layer pool;
        # its indexer (if any) is a full one: nothing before it to share.
        block_config = replace(
            config,
            num_layers=1,
            mlp_layer_types=("sparse" if weights.layer.moe is not None else "dense",),
            indexer_types=("full",) if config.has_indexer else (),
        )
        block_plan = replace(plan, layer_start=0, layer_end=1)
        block_weights = MlaModelWeights(weights.embed, [weights.layer], None, None)
        self.block = MlaDecoderShard(block_config, block_plan, block_weights, pool, comm)

    def forward(self, previous_hidden: torch.Tensor, batch: ForwardBatch):
        """`batch.token_ids` are the tokens t[i+1], `batch.positions` the slots
        i, `previous_hidden` the h_i (or a chained g). Returns (g, logits) of
        `batch.last_rows` (every row when None)."""
        w, eps = self.weights, self.config.rms_norm_eps
        embedded = F.embedding(batch.token_ids, w.embed)
        joined = torch.cat(
            [rms_norm(embedded, w.enorm, eps), rms_norm(previous_hidden, w.hnorm, eps)], -1
        )
        x = F.linear(joined, w.eh_proj)
        positions = batch.positions + 1 if self.positions == "shifted" else batch.positions
        cos, sin = self.block.rope.cos_sin(positions, x.dtype)
        x, _ = self.block.layer(0, w.layer, x, cos, sin, batch, None)
        if batch.last_rows is not None:
            x = x[batch.last_rows]
        g = rms_norm(x, w.head_norm, eps)
        return g, F.linear(g, w.lm_head)


def load_mla_draft(
    model_dir, config: MlaConfig, target: ModelKVSpec, plan, dtype, geometry, comm, positions,
    device, k: int,
) -> SpecDecoder:  # fmt: skip
    """K-token speculation with the MTP layer: the layer and its draft pool
    (as many pages as the target's) on the last PP stage, none elsewhere."""
    if config.num_mtp_layers < 1:
        raise ModelLoadError(
            f"{model_dir}: --speculative needs an MTP layer (num_nextn_predict_layers)"
        )
    _, indexed = mtp_layer_kind(_Reader(model_dir, dtype, device), config)
    spec = mla_draft_kv_spec(target, config, positions, indexed)
    if not plan.last_stage:
        return SpecDecoder(None, spec, k)
    pool = LatentKVPool(
        num_pages=geometry[0],
        page_size=geometry[1],
        num_layers=1,
        latent_dim=config.latent_dim,
        index_dim=config.index_head_dim if indexed else 0,
        index_local_layers=(0,) if indexed else (),
        dtype=dtype,
        device=device,
    )
    weights = load_mla_mtp_weights(model_dir, config, plan, dtype, device)
    return SpecDecoder(MlaMtpLayer(config, plan, weights, pool, comm, positions), spec, k)
