"""Configuration of the MLA family (GLM-5, DeepSeek-V3.2, DeepSeek-V3) read
from a Hugging Face `config.json`.

Fields follow transformers 5.24's `GlmMoeDsaConfig`, `DeepseekV32Config` and
`DeepseekV3Config`, with their defaults where a field is absent; derived
per-layer patterns (`indexer_types`, `mlp_layer_types`) are computed as those
configs compute them, so a checkpoint that stores only `index_topk_freq` or
`first_k_dense_replace` reads the same as one that stores the lists.

`head_dim` is the RoPE width (`qk_rope_head_dim`), as in transformers: the
shared rotary tables of `kvrelay.model.rope` read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvrelay.model.config import ROPE_TYPES, _rope_settings
from kvrelay.model.errors import ModelLoadError

# model_type -> (HF class, DSA indexer, indexer RoPE interleaved)
MLA_ARCHITECTURES: dict[str, tuple[str, bool, bool]] = {
    "glm_moe_dsa": ("GlmMoeDsaForCausalLM", True, True),
    "deepseek_v32": ("DeepseekV32ForCausalLM", True, False),
    "deepseek_v3": ("DeepseekV3ForCausalLM", False, False),
}

# Defaults of fields a config.json may leave out, per model type.
_DEFAULTS = {
    "glm_moe_dsa": {"rms_norm_eps": 1e-5, "n_group": 1, "topk_group": 1, "index_n_heads": 32},
    "deepseek_v32": {"rms_norm_eps": 1e-6, "n_group": 8, "topk_group": 4, "index_n_heads": 64},
    "deepseek_v3": {"rms_norm_eps": 1e-6, "n_group": 8, "topk_group": 4},
}


@dataclass(frozen=True, slots=True)
class MlaConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP layers
    num_layers: int
    num_heads: int
    q_lora_rank: int | None  # None: a plain q_proj (DeepSeek-V3 "lite" shapes)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    mlp_layer_types: tuple[str, ...]  # "dense" | "sparse" per layer
    indexer_types: tuple[str, ...]  # "full" | "shared" per layer; () without DSA
    index_topk: int = 0
    index_head_dim: int = 0
    index_n_heads: int = 0
    rope_interleave: bool = True  # the MLA attention's RoPE layout
    attention_bias: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    num_mtp_layers: int = 0

    @property
    def head_dim(self) -> int:
        """The rotary width (what transformers' `config.head_dim` is for this family)."""
        return self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of a latent row: normed compressed KV ++ post-RoPE shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def has_indexer(self) -> bool:
        return bool(self.indexer_types)

    @property
    def indexer_rope_interleave(self) -> bool:
        return MLA_ARCHITECTURES[self.arch][2]

    @property
    def index_layers(self) -> tuple[int, ...]:
        """Global layers whose indexer runs (and whose pages carry indexer keys)."""
        return tuple(i for i, kind in enumerate(self.indexer_types) if kind == "full")

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times yarn's mscale(factor, mscale_all_dim)^2 as
        transformers' `yarn_apply_mscale` does (any non-default RoPE type)."""
        scale = self.qk_head_dim**-0.5
        scaling = self.rope_scaling or {}
        weight = scaling.get("mscale_all_dim", 0)
        if self.rope_type != "default" and weight:
            factor = float(scaling["factor"])
            mscale = 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0
            scale = scale * mscale * mscale
        return scale

    def __post_init__(self) -> None:
        if self.arch not in MLA_ARCHITECTURES:
            raise ModelLoadError(
                f"architecture {self.arch!r} is not one of {tuple(MLA_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "kv_lora_rank",
                     "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelLoadError(f"config field {name} must be a positive int, got {value!r}")
        if self.qk_rope_head_dim % 2:
            raise ModelLoadError("qk_rope_head_dim must be even")
        if len(self.mlp_layer_types) != self.num_layers or set(self.mlp_layer_types) - {
            "dense",
            "sparse",
        }:
            raise ModelLoadError(f"mlp_layer_types {self.mlp_layer_types!r} is not one per layer")
        if "sparse" in self.mlp_layer_types:
            if self.n_routed_experts <= 0 or self.num_experts_per_tok <= 0:
                raise ModelLoadError("MoE layers need n_routed_experts and num_experts_per_tok")
            if self.n_routed_experts % self.n_group:
                raise ModelLoadError(f"n_group {self.n_group} does not divide the experts")
        if self.indexer_types:
            if len(self.indexer_types) != self.num_layers or set(self.indexer_types) - {
                "full",
                "shared",
            }:
                raise ModelLoadError(f"indexer_types {self.indexer_types!r} is not one per layer")
            if self.indexer_types[0] != "full":
                raise ModelLoadError("the first layer's indexer must run (indexer_types[0] full)")
            if self.q_lora_rank is None:
                raise ModelLoadError("the DSA indexer needs q_lora_rank")
            if min(self.index_topk, self.index_head_dim, self.index_n_heads) <= 0:
                raise ModelLoadError(
                    "the DSA indexer needs index_topk, index_head_dim, index_n_heads"
                )
            if self.index_head_dim < self.qk_rope_head_dim:
                raise ModelLoadError("index_head_dim is narrower than the RoPE part")
        rope_type = self.rope_type
        if rope_type not in ROPE_TYPES:
            raise ModelLoadError(
                f"rope scaling type {rope_type!r} is not one of {tuple(ROPE_TYPES)}"
            )
        missing = [k for k in ROPE_TYPES[rope_type] if k not in (self.rope_scaling or {})]
        if missing:
            raise ModelLoadError(f"rope scaling {rope_type!r} needs {missing}")

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> MlaConfig:
        model_type, mtp_layers = _refuse_unsupported(raw, source)
        defaults = _DEFAULTS[model_type]
        try:
            layers = int(raw["num_hidden_layers"])
            rope_theta, rope_scaling = _rope_settings(raw)
            eos = raw.get("eos_token_id")
            eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
            q_lora = raw.get("q_lora_rank")
            return cls(
                arch=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=int(raw["hidden_size"]),
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=layers,
                num_heads=int(raw["num_attention_heads"]),
                q_lora_rank=None if q_lora is None else int(q_lora),
                kv_lora_rank=int(raw["kv_lora_rank"]),
                qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
                qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
                v_head_dim=int(raw["v_head_dim"]),
                moe_intermediate_size=int(raw.get("moe_intermediate_size", 0)),
                n_routed_experts=int(raw.get("n_routed_experts") or raw.get("num_experts") or 0),
                n_shared_experts=int(raw.get("n_shared_experts") or 0),
                num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
                n_group=int(raw.get("n_group") or defaults["n_group"]),
                topk_group=int(raw.get("topk_group") or defaults["topk_group"]),
                norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
                routed_scaling_factor=float(raw.get("routed_scaling_factor", 2.5)),
                mlp_layer_types=_mlp_layer_types(raw, model_type, layers),
                indexer_types=_indexer_types(raw, model_type, layers),
                **_indexer_fields(raw, model_type),
                # GLM-5 and V3.2 always rotate the MLA rope part interleaved;
                # V3 says so in `rope_interleave` (default True).
                rope_interleave=bool(raw.get("rope_interleave", True))
                if model_type == "deepseek_v3"
                else True,
                attention_bias=bool(raw.get("attention_bias", False)),
                rms_norm_eps=float(raw.get("rms_norm_eps", defaults["rms_norm_eps"])),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                eos_token_ids=eos_ids,
                num_mtp_layers=int(mtp_layers),
            )
        except KeyError as missing:
            raise ModelLoadError(f"{source}: missing field {missing.args[0]!r}") from None
        except (TypeError, ValueError) as bad:
            if isinstance(bad, ModelLoadError):
                raise ModelLoadError(f"{source}: {bad}") from None
            raise ModelLoadError(f"{source}: bad value: {bad}") from None


def _refuse_unsupported(raw: dict, source: str) -> tuple[str, int]:
    """(model type, MTP layers) of a config this runner can run, else ModelLoadError."""
    model_type = raw.get("model_type")
    if model_type not in MLA_ARCHITECTURES:
        raise ModelLoadError(f"{source}: model_type {model_type!r} is not an MLA model")
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported")
    if raw.get("quantization_config"):
        # Released DeepSeek weights are FP8 with block scales; reading them
        # as plain tensors would be silently wrong.
        raise ModelLoadError(
            f"{source}: quantized checkpoints (quantization_config) are not supported; "
            "dequantize to bfloat16 first"
        )
    mtp_layers = raw.get("num_nextn_predict_layers") or 0
    if mtp_layers not in (0, 1):
        raise ModelLoadError(
            f"{source}: num_nextn_predict_layers {mtp_layers!r} is not supported (0 or 1)"
        )
    return model_type, mtp_layers


def _indexer_fields(raw: dict, model_type: str) -> dict:
    """index_topk, index_head_dim, index_n_heads (zero without DSA)."""
    if not MLA_ARCHITECTURES[model_type][1]:
        return {"index_topk": 0, "index_head_dim": 0, "index_n_heads": 0}
    return {
        "index_topk": int(raw.get("index_topk", 2048)),
        "index_head_dim": int(raw.get("index_head_dim", 128)),
        "index_n_heads": int(raw.get("index_n_heads") or _DEFAULTS[model_type]["index_n_heads"]),
    }


def _mlp_layer_types(raw: dict, model_type: str, layers: int) -> tuple[str, ...]:
    """V3 reads `first_k_dense_replace` only; GLM-5 and V3.2 prefer `mlp_layer_types`."""
    if model_type != "deepseek_v3" and raw.get("mlp_layer_types") is not None:
        return tuple(raw["mlp_layer_types"])
    dense = min(int(raw.get("first_k_dense_replace", 3)), layers)
    return ("dense",) * dense + ("sparse",) * (layers - dense)


def _indexer_types(raw: dict, model_type: str, layers: int) -> tuple[str, ...]:
    """transformers' derivation: V3.2 runs every layer's indexer; GLM-5 reads
    `indexer_types`, else `index_topk_pattern`, else the freq/offset schedule."""
    if model_type == "deepseek_v3":
        return ()
    if model_type == "deepseek_v32":
        return ("full",) * layers
    if raw.get("indexer_types") is not None:
        return tuple(raw["indexer_types"])
    pattern = raw.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            return tuple({"F": "full", "S": "shared"}[c] for c in pattern)
        return tuple(pattern)
    freq = max(int(raw.get("index_topk_freq", 1)), 1)
    offset = int(raw.get("index_skip_topk_offset", 2))
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers))
