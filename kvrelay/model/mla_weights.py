"""A rank's share of an MLA-family checkpoint (GLM-5, DeepSeek-V3.2, V3).

TP split (each rank reads only its slices):
- MLA: query heads are split. q_a_proj / q_a_layernorm / kv_a_proj_with_mqa /
  kv_a_layernorm are replicated (every rank computes the same latent row,
  which is why the latent page has one head and one replica writes it);
  q_b_proj (or q_proj) and kv_b_proj rows and o_proj columns follow the heads.
- DSA indexer: replicated. Its top-k needs the score summed over all its
  heads, so every rank computes the same selection instead of all-reducing
  partial scores.
- MLPs: the dense MLP, each routed expert and the shared experts are split by
  intermediate columns; the router is replicated, so every rank routes alike,
  and one all-reduce sums routed and shared parts.
Row-parallel outputs (o_proj, down projections) are partial sums,
all-reduced by the decoder before any bias.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvrelay.model.errors import ModelLoadError
from kvrelay.model.mla_config import MlaConfig
from kvrelay.model.weights import _Reader

# Dtypes for which transformers keeps the indexer's weights_proj in float32
# (`_keep_in_fp32_modules`); in float32 and float64 it has the model's dtype.
_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True, slots=True)
class MlaShardPlan:
    """Query heads [q_head_start, +num_q_heads); dense MLP columns
    [mlp_start, +mlp_size); each routed expert's columns [moe_start,
    +moe_size); shared experts' columns [shared_start, +shared_size); layers
    [layer_start, layer_end). The latent is one replicated KV head."""

    q_head_start: int
    num_q_heads: int
    mlp_start: int
    mlp_size: int
    moe_start: int
    moe_size: int
    shared_start: int
    shared_size: int
    layer_start: int
    layer_end: int
    first_stage: bool
    last_stage: bool
    kv_head_start: int = 0
    num_kv_heads: int = 1

    @classmethod
    def split(cls, config: MlaConfig, tp: int, tp_rank: int, layers, first, last):
        for what, size in (
            ("attention heads", config.num_heads),
            ("intermediate_size", config.intermediate_size),
            ("moe_intermediate_size", config.moe_intermediate_size),
        ):
            if size % tp:
                raise ModelLoadError(f"tp={tp} does not divide {what} {size}")
        heads = config.num_heads // tp
        mlp = config.intermediate_size // tp
        moe = config.moe_intermediate_size // tp
        shared = moe * config.n_shared_experts
        return cls(tp_rank * heads, heads, tp_rank * mlp, mlp, tp_rank * moe, moe,
                   tp_rank * shared, shared, layers[0], layers[1], first, last)  # fmt: skip

    @classmethod
    def whole(cls, config: MlaConfig) -> MlaShardPlan:
        return cls.split(config, 1, 0, (0, config.num_layers), True, True)


@dataclass(slots=True)
class IndexerWeights:
    wq_b: torch.Tensor  # [index_heads * index_head_dim, q_lora_rank]
    wk: torch.Tensor  # [index_head_dim, hidden]
    k_norm: torch.Tensor  # LayerNorm weight and bias
    k_norm_bias: torch.Tensor
    weights_proj: torch.Tensor  # [index_heads, hidden]


@dataclass(slots=True)
class MoeWeights:
    gate: torch.Tensor  # float32 [experts, hidden]
    bias: torch.Tensor  # float32 [experts] (e_score_correction_bias)
    gate_proj: torch.Tensor  # [experts, local columns, hidden]
    up_proj: torch.Tensor
    down_proj: torch.Tensor  # [experts, hidden, local columns]
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # gate, up, down


@dataclass(slots=True)
class MlaLayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_a_proj: torch.Tensor | None  # None: q_proj (no q LoRA)
    q_a_bias: torch.Tensor | None
    q_a_norm: torch.Tensor | None
    q_proj: torch.Tensor  # q_b_proj (or q_proj): this rank's heads
    kv_a_proj: torch.Tensor
    kv_a_bias: torch.Tensor | None
    kv_a_norm: torch.Tensor
    w_uk: torch.Tensor  # [local heads, qk_nope, kv_lora_rank] (kv_b_proj's K rows)
    w_uv: torch.Tensor  # [local heads, v_head_dim, kv_lora_rank] (its V rows)
    o_proj: torch.Tensor  # [hidden, local heads * v_head_dim]
    o_bias: torch.Tensor | None  # added once, after the TP all-reduce
    indexer: IndexerWeights | None
    dense: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # gate, up, down
    moe: MoeWeights | None


@dataclass(slots=True)
class MlaModelWeights:
    embed: torch.Tensor | None
    layers: list[MlaLayerWeights]
    final_norm: torch.Tensor | None
    lm_head: torch.Tensor | None


def load_mla_weights(
    model_dir: str | Path,
    config: MlaConfig,
    plan: MlaShardPlan,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> MlaModelWeights:
    reader = _Reader(model_dir, dtype, device)
    hidden = config.hidden_size
    layers = [
        read_mla_layer(reader, config, plan, i, _is_sparse(config, i), _indexer_runs(config, i))
        for i in range(plan.layer_start, plan.layer_end)
    ]
    shape = (config.vocab_size, hidden)
    embed = lm_head = final_norm = None
    if plan.first_stage:
        embed = reader.read("model.embed_tokens.weight", shape)
    if plan.last_stage:
        final_norm = reader.read("model.norm.weight", (hidden,))
        if config.tie_word_embeddings:
            lm_head = (
                embed if embed is not None else reader.read("model.embed_tokens.weight", shape)
            )
        else:
            lm_head = reader.read("lm_head.weight", shape)
    return MlaModelWeights(embed, layers, final_norm, lm_head)


def _is_sparse(config: MlaConfig, layer: int) -> bool:
    return config.mlp_layer_types[layer] == "sparse"


def _indexer_runs(config: MlaConfig, layer: int) -> bool:
    return config.has_indexer and config.indexer_types[layer] == "full"


def read_mla_layer(
    reader: _Reader, config: MlaConfig, plan: MlaShardPlan, index: int, sparse: bool, indexed: bool
) -> MlaLayerWeights:
    """Layer `index`'s tensors (`model.layers.{index}.*`), `plan`'s share."""
    c, hidden = config, config.hidden_size
    p = f"model.layers.{index}."
    a = p + "self_attn."
    h0, h1 = plan.q_head_start, plan.q_head_start + plan.num_q_heads
    qk, heads = c.qk_head_dim, c.num_heads
    q_rows = (h0 * qk, h1 * qk)
    bias = c.attention_bias

    if c.q_lora_rank is None:
        q_a = q_a_bias = q_a_norm = None
        q_proj = reader.read(a + "q_proj.weight", (heads * qk, hidden), q_rows)
    else:
        r = c.q_lora_rank
        q_a = reader.read(a + "q_a_proj.weight", (r, hidden))
        q_a_bias = reader.read(a + "q_a_proj.bias", (r,)) if bias else None
        q_a_norm = reader.read(a + "q_a_layernorm.weight", (r,))
        q_proj = reader.read(a + "q_b_proj.weight", (heads * qk, r), q_rows)
    latent = c.latent_dim
    kvb = c.qk_nope_head_dim + c.v_head_dim
    kv_b = reader.read(
        a + "kv_b_proj.weight", (heads * kvb, c.kv_lora_rank), (h0 * kvb, h1 * kvb)
    ).view(plan.num_q_heads, kvb, c.kv_lora_rank)
    v_cols = (h0 * c.v_head_dim, h1 * c.v_head_dim)
    mlp = (plan.mlp_start, plan.mlp_start + plan.mlp_size)
    return MlaLayerWeights(
        input_norm=reader.read(p + "input_layernorm.weight", (hidden,)),
        post_norm=reader.read(p + "post_attention_layernorm.weight", (hidden,)),
        q_a_proj=q_a,
        q_a_bias=q_a_bias,
        q_a_norm=q_a_norm,
        q_proj=q_proj,
        kv_a_proj=reader.read(a + "kv_a_proj_with_mqa.weight", (latent, hidden)),
        kv_a_bias=reader.read(a + "kv_a_proj_with_mqa.bias", (latent,)) if bias else None,
        kv_a_norm=reader.read(a + "kv_a_layernorm.weight", (c.kv_lora_rank,)),
        w_uk=kv_b[:, : c.qk_nope_head_dim].contiguous(),
        w_uv=kv_b[:, c.qk_nope_head_dim :].contiguous(),
        o_proj=reader.read(a + "o_proj.weight", (hidden, heads * c.v_head_dim), None, v_cols),
        o_bias=reader.read(a + "o_proj.bias", (hidden,)) if bias else None,
        indexer=_read_indexer(reader, c, a + "indexer.") if indexed else None,
        dense=None if sparse else _read_mlp(reader, p + "mlp.", c.intermediate_size, hidden, mlp),
        moe=_read_moe(reader, c, plan, p + "mlp.") if sparse else None,
    )


def _read_indexer(reader: _Reader, c: MlaConfig, i: str) -> IndexerWeights:
    d, hidden = c.index_head_dim, c.hidden_size
    weights_reader = _float32(reader) if reader.dtype in _HALF else reader
    weights_proj = weights_reader.read(i + "weights_proj.weight", (c.index_n_heads, hidden))
    return IndexerWeights(
        wq_b=reader.read(i + "wq_b.weight", (c.index_n_heads * d, c.q_lora_rank)),
        wk=reader.read(i + "wk.weight", (d, hidden)),
        k_norm=reader.read(i + "k_norm.weight", (d,)),
        k_norm_bias=reader.read(i + "k_norm.bias", (d,)),
        weights_proj=weights_proj,
    )


def _float32(reader: _Reader) -> _Reader:
    """The same files (and open handles), read as float32."""
    copy = _Reader.__new__(_Reader)
    copy.__dict__.update(reader.__dict__)
    copy.dtype = torch.float32
    return copy


def _read_mlp(reader: _Reader, m: str, inter: int, hidden: int, cols):
    return (
        reader.read(m + "gate_proj.weight", (inter, hidden), cols),
        reader.read(m + "up_proj.weight", (inter, hidden), cols),
        reader.read(m + "down_proj.weight", (hidden, inter), None, cols),
    )


def _read_moe(reader: _Reader, c: MlaConfig, plan: MlaShardPlan, m: str) -> MoeWeights:
    hidden, inter = c.hidden_size, c.moe_intermediate_size
    cols = (plan.moe_start, plan.moe_start + plan.moe_size)
    experts = [
        _read_mlp(reader, f"{m}experts.{e}.", inter, hidden, cols)
        for e in range(c.n_routed_experts)
    ]
    shared = None
    if c.n_shared_experts:
        width = inter * c.n_shared_experts
        shared_cols = (plan.shared_start, plan.shared_start + plan.shared_size)
        shared = _read_mlp(reader, m + "shared_experts.", width, hidden, shared_cols)
    # The router runs in float32 whatever the model dtype, as transformers'
    # (`_keep_in_fp32_modules_strict`) and the released checkpoints do.
    router = _float32(reader)
    gate = router.read(m + "gate.weight", (c.n_routed_experts, hidden))
    bias = router.read(m + "gate.e_score_correction_bias", (c.n_routed_experts,))
    return MoeWeights(
        gate=gate,
        bias=bias,
        gate_proj=torch.stack([e[0] for e in experts]),
        up_proj=torch.stack([e[1] for e in experts]),
        down_proj=torch.stack([e[2] for e in experts]),
        shared=shared,
    )
