"""`kvrelay make-model --arch glm5|deepseek_v32|deepseek_v3`: a random model of
the MLA family in the layout its released checkpoints use.

Experts are stored one tensor per projection and expert
(`mlp.experts.{e}.gate_proj.weight`, DeepSeek's and GLM's format, which
transformers fuses on load); the router's weight and score-correction bias
are float32 whatever the checkpoint dtype, as in the released models. MTP
layers follow the decoder layers as `model.layers.{num_hidden_layers}.*`
(`enorm`, `hnorm`, `eh_proj`, a decoder layer with an MoE MLP, and
`shared_head.norm`), which transformers ignores and kvrelay's draft reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvrelay.model.config import TORCH_DTYPES
from kvrelay.model.make_model import write_checkpoint

# --arch name -> (model_type, HF class)
MLA_ARCHS = {
    "glm5": ("glm_moe_dsa", "GlmMoeDsaForCausalLM"),
    "deepseek_v32": ("deepseek_v32", "DeepseekV32ForCausalLM"),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3ForCausalLM"),
}


@dataclass(frozen=True, slots=True)
class MlaModelSpec:
    arch: str = "glm5"
    layers: int = 3
    hidden: int = 64
    heads: int = 4
    vocab: int = 256
    intermediate: int = 128  # dense MLP layers
    moe_intermediate: int = 32
    experts: int = 8
    shared_experts: int = 1
    experts_per_token: int = 2
    groups: int = 2
    topk_groups: int = 1
    first_dense: int = 1  # first_k_dense_replace
    q_lora_rank: int | None = 48  # None: plain q_proj (DeepSeek-V3 only)
    kv_lora_rank: int = 32
    qk_nope: int = 16
    qk_rope: int = 16
    v_head_dim: int = 16
    index_topk: int = 32
    index_head_dim: int = 32
    index_heads: int = 16
    # GLM-5: the indexer runs on layer i when max(i - 1, 0) % freq == 0, the
    # others reuse the previous full layer's top-k.
    index_topk_freq: int = 1
    routed_scaling: float = 2.5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_positions: int = 16384
    tie_embeddings: bool = False
    attention_bias: bool = False  # q_a_proj, kv_a_proj_with_mqa and o_proj biases
    rope_interleave: bool = True  # deepseek_v3 only (GLM-5 and V3.2 always interleave)
    std: float = 0.05
    seed: int = 0
    dtype: str = "float32"
    shards: int = 1
    mtp: int = 0
    mtp_init: str = "random"  # or "copy": the MTP decoder layer is layer 0's copy

    @property
    def model_type(self) -> str:
        return MLA_ARCHS[self.arch][0]

    @property
    def has_indexer(self) -> bool:
        return self.arch != "deepseek_v3"

    def config_json(self) -> dict:
        config = {
            "architectures": [MLA_ARCHS[self.arch][1]],
            "model_type": self.model_type,
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "moe_intermediate_size": self.moe_intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.heads,
            "n_shared_experts": self.shared_experts,
            "n_routed_experts": self.experts,
            "num_experts_per_tok": self.experts_per_token,
            "n_group": self.groups,
            "topk_group": self.topk_groups,
            "norm_topk_prob": True,
            "routed_scaling_factor": self.routed_scaling,
            "first_k_dense_replace": self.first_dense,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope,
            "qk_rope_head_dim": self.qk_rope,
            "v_head_dim": self.v_head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_positions,
            "rms_norm_eps": 1e-6,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "attention_bias": self.attention_bias,
            "tie_word_embeddings": self.tie_embeddings,
            "torch_dtype": self.dtype,
            "bos_token_id": None,
            "eos_token_id": None,
            "pad_token_id": None,
        }
        if self.has_indexer:
            config |= {
                "index_topk": self.index_topk,
                "index_head_dim": self.index_head_dim,
                "index_n_heads": self.index_heads,
            }
        if self.arch == "glm5":
            config |= {"index_topk_freq": self.index_topk_freq, "index_skip_topk_offset": 2}
        if self.arch == "deepseek_v3":
            # As DeepSeek-V3's released config: engines that do not assume
            # the router (vLLM defaults to softmax without a correction bias)
            # read it from here.
            config |= {"rope_interleave": self.rope_interleave, "topk_method": "noaux_tc",
                       "scoring_func": "sigmoid"}  # fmt: skip
        if self.mtp:
            config["num_nextn_predict_layers"] = self.mtp
        return config

    def indexer_runs(self, layer: int) -> bool:
        if not self.has_indexer:
            return False
        if self.arch != "glm5" or layer >= self.layers:  # the MTP layer runs its own
            return True
        return max(layer - 1, 0) % self.index_topk_freq == 0


def random_mla_weights(spec: MlaModelSpec) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(spec.seed)

    def normal(*shape: int, std: float = spec.std) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * std

    def norm(width: int = spec.hidden) -> torch.Tensor:
        return 1 + torch.randn(width, generator=gen, dtype=torch.float64) * 0.1

    hidden = spec.hidden
    tensors = {"model.embed_tokens.weight": normal(spec.vocab, hidden)}
    for layer in range(spec.layers):
        sparse = layer >= spec.first_dense
        tensors |= _layer(spec, layer, sparse, normal, norm)
    tensors["model.norm.weight"] = norm()
    if not spec.tie_embeddings:
        tensors["lm_head.weight"] = normal(spec.vocab, hidden)
    if spec.mtp:
        # Drawn after the target's tensors: the target is the same model with
        # or without an MTP layer.
        p = f"model.layers.{spec.layers}."
        tensors |= _layer(spec, spec.layers, True, normal, norm)
        tensors |= {
            p + "enorm.weight": norm(),
            p + "hnorm.weight": norm(),
            p + "eh_proj.weight": normal(hidden, 2 * hidden),
            p + "shared_head.norm.weight": norm(),
        }
        if spec.mtp_init == "copy":
            # The random draws stay drawn (the RNG stream is the same), but the
            # layer's tensors are replaced by layer 0's.
            tensors = {n: t for n, t in tensors.items() if not n.startswith(p)}
            tensors |= _copy_first_layer(spec, tensors)
    dtype = TORCH_DTYPES[spec.dtype]
    return {
        name: t.to(torch.float32 if _router_tensor(name) else dtype).contiguous()
        for name, t in tensors.items()
    }


def _router_tensor(name: str) -> bool:
    return name.endswith(("mlp.gate.weight", "mlp.gate.e_score_correction_bias"))


def _layer(spec: MlaModelSpec, layer: int, sparse: bool, normal, norm) -> dict:
    p = f"model.layers.{layer}."
    a = p + "self_attn."
    hidden, heads = spec.hidden, spec.heads
    qk = spec.qk_nope + spec.qk_rope
    t = {p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm()}
    if spec.q_lora_rank is None:
        t[a + "q_proj.weight"] = normal(heads * qk, hidden)
    else:
        t[a + "q_a_proj.weight"] = normal(spec.q_lora_rank, hidden)
        t[a + "q_a_layernorm.weight"] = norm(spec.q_lora_rank)
        t[a + "q_b_proj.weight"] = normal(heads * qk, spec.q_lora_rank)
    t[a + "kv_a_proj_with_mqa.weight"] = normal(spec.kv_lora_rank + spec.qk_rope, hidden)
    if spec.attention_bias:
        t[a + "kv_a_proj_with_mqa.bias"] = normal(spec.kv_lora_rank + spec.qk_rope)
        t[a + "o_proj.bias"] = normal(hidden)
        if spec.q_lora_rank is not None:
            t[a + "q_a_proj.bias"] = normal(spec.q_lora_rank)
    t[a + "kv_a_layernorm.weight"] = norm(spec.kv_lora_rank)
    t[a + "kv_b_proj.weight"] = normal(heads * (spec.qk_nope + spec.v_head_dim), spec.kv_lora_rank)
    t[a + "o_proj.weight"] = normal(hidden, heads * spec.v_head_dim)
    if spec.indexer_runs(layer):
        i = a + "indexer."
        t[i + "wq_b.weight"] = normal(spec.index_heads * spec.index_head_dim, spec.q_lora_rank)
        t[i + "wk.weight"] = normal(spec.index_head_dim, hidden)
        t[i + "k_norm.weight"] = norm(spec.index_head_dim)
        t[i + "k_norm.bias"] = normal(spec.index_head_dim, std=0.1)
        t[i + "weights_proj.weight"] = normal(spec.index_heads, hidden)
    m = p + "mlp."
    if not sparse:
        t[m + "gate_proj.weight"] = normal(spec.intermediate, hidden)
        t[m + "up_proj.weight"] = normal(spec.intermediate, hidden)
        t[m + "down_proj.weight"] = normal(hidden, spec.intermediate)
        return t
    inter = spec.moe_intermediate
    t[m + "gate.weight"] = normal(spec.experts, hidden)
    # A visible bias, so routing by score + bias differs from routing by score.
    t[m + "gate.e_score_correction_bias"] = normal(spec.experts, std=0.1)
    for e in range(spec.experts):
        x = f"{m}experts.{e}."
        t[x + "gate_proj.weight"] = normal(inter, hidden)
        t[x + "up_proj.weight"] = normal(inter, hidden)
        t[x + "down_proj.weight"] = normal(hidden, inter)
    shared = inter * spec.shared_experts
    if shared:
        t[m + "shared_experts.gate_proj.weight"] = normal(shared, hidden)
        t[m + "shared_experts.up_proj.weight"] = normal(shared, hidden)
        t[m + "shared_experts.down_proj.weight"] = normal(hidden, shared)
    return t


def _copy_first_layer(spec: MlaModelSpec, tensors: dict) -> dict[str, torch.Tensor]:
    """The MTP layer re-runs the target's first layer one token ahead (as
    `make_model.copy_target_layer` does for Llama): eh_proj passes the normed
    embedding through, enorm rescales it to the embeddings' RMS, the decoder
    layer (MLP included) is layer 0's copy, shared_head.norm the final norm.
    A draft that agrees with a one-layer target often."""
    p, src = f"model.layers.{spec.layers}.", "model.layers.0."
    out = {p + n[len(src) :]: t.clone() for n, t in tensors.items() if n.startswith(src)}
    embed = tensors["model.embed_tokens.weight"]
    hidden = embed.size(1)
    out[p + "enorm.weight"] = torch.full((hidden,), float(embed.pow(2).mean(-1).sqrt().mean()))
    out[p + "hnorm.weight"] = torch.ones(hidden, dtype=torch.float64)
    out[p + "eh_proj.weight"] = torch.cat(
        [torch.eye(hidden, dtype=torch.float64), torch.zeros(hidden, hidden, dtype=torch.float64)],
        1,
    )
    out[p + "shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
    return out


def add_mla_arguments(parser) -> None:
    """make-model flags of the MLA family (defaults: `MlaModelSpec`'s)."""
    d = MlaModelSpec()
    group = parser.add_argument_group("glm5 / deepseek_v32 / deepseek_v3")
    for flag, value, text in (
        ("--experts", d.experts, "routed experts"),
        ("--shared-experts", d.shared_experts, "shared experts"),
        ("--experts-per-token", d.experts_per_token, "num_experts_per_tok"),
        ("--groups", d.groups, "expert groups (n_group)"),
        ("--topk-groups", d.topk_groups, "groups kept per token (topk_group)"),
        ("--moe-intermediate", d.moe_intermediate, "each expert's width"),
        ("--first-dense", d.first_dense, "first_k_dense_replace"),
        ("--q-lora-rank", d.q_lora_rank, "0: plain q_proj (deepseek_v3 only)"),
        ("--kv-lora-rank", d.kv_lora_rank, "compressed KV width"),
        ("--qk-nope-dim", d.qk_nope, "qk_nope_head_dim"),
        ("--qk-rope-dim", d.qk_rope, "qk_rope_head_dim"),
        ("--v-head-dim", d.v_head_dim, "v_head_dim"),
        ("--index-topk", d.index_topk, "DSA: tokens each query attends to"),
        ("--index-heads", d.index_heads, "DSA indexer heads"),
        ("--index-head-dim", d.index_head_dim, "DSA indexer key width"),
        ("--index-topk-freq", d.index_topk_freq, "glm5: indexer on every N-th layer"),
    ):
        group.add_argument(flag, type=int, default=value, help=text)


def mla_spec_of(args) -> MlaModelSpec:
    """The MlaModelSpec of parsed make-model arguments."""
    return MlaModelSpec(
        arch=args.arch, layers=args.layers, hidden=args.hidden, heads=args.heads,
        vocab=args.vocab, intermediate=args.intermediate or 2 * args.hidden,
        moe_intermediate=args.moe_intermediate, experts=args.experts,
        shared_experts=args.shared_experts, experts_per_token=args.experts_per_token,
        groups=args.groups, topk_groups=args.topk_groups, first_dense=args.first_dense,
        q_lora_rank=args.q_lora_rank or None, kv_lora_rank=args.kv_lora_rank,
        qk_nope=args.qk_nope_dim, qk_rope=args.qk_rope_dim, v_head_dim=args.v_head_dim,
        index_topk=args.index_topk, index_heads=args.index_heads,
        index_head_dim=args.index_head_dim, index_topk_freq=args.index_topk_freq,
        rope_theta=args.rope_theta, max_positions=args.max_positions,
        tie_embeddings=args.tie_embeddings, std=args.std, seed=args.seed, dtype=args.dtype,
        shards=args.shards, mtp=args.mtp, mtp_init=args.mtp_init,
    )  # fmt: skip


def write_mla_model(directory: str | Path, spec: MlaModelSpec) -> Path:
    """Writes the model into `directory` (created if missing) and returns it."""
    if spec.arch not in MLA_ARCHS:
        raise ValueError(f"arch must be one of {sorted(MLA_ARCHS)}, got {spec.arch!r}")
    if spec.dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(TORCH_DTYPES)}")
    if spec.q_lora_rank is None and spec.has_indexer:
        raise ValueError("the DSA indexer reads the q_lora path: q_lora_rank is required")
    if spec.mtp not in (0, 1) or spec.mtp_init not in ("random", "copy") or spec.shards < 1:
        raise ValueError("mtp must be 0 or 1, mtp_init random or copy, shards >= 1")
    if spec.experts % spec.groups or spec.experts // spec.groups < 2:
        raise ValueError("groups must divide the experts, two or more per group")
    return write_checkpoint(directory, spec.config_json(), spec.vocab, random_mla_weights(spec),
                            spec.shards)  # fmt: skip
