"""Model configuration read from a Hugging Face `config.json`.

Only the fields that change the computation are kept. Both spellings of the
RoPE settings are read: the classic `rope_theta` + `rope_scaling` pair and the
newer `rope_parameters` dict.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvrelay.model.errors import ModelLoadError

ARCHITECTURES = ("llama", "qwen2")

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# RoPE scaling types this runner implements (see rope.py), with the fields
# each needs. Dynamic NTK is left out on purpose: it rescales positions by the
# current length, so K already in the cache would no longer match K computed later.
ROPE_TYPES: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "yarn": (),
}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # DeepSeek-V3 style MTP layers stored after the decoder layers
    # (`num_nextn_predict_layers`); kvrelay runs at most one.
    num_mtp_layers: int = 0

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ModelLoadError(f"architecture {self.arch!r} is not one of {ARCHITECTURES}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelLoadError(f"config field {name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"{self.num_heads} attention heads are not a multiple of "
                f"{self.num_kv_heads} KV heads"
            )
        rope_type = self.rope_type
        if rope_type not in ROPE_TYPES:
            raise ModelLoadError(
                f"rope scaling type {rope_type!r} is not one of {tuple(ROPE_TYPES)}"
            )
        missing = [k for k in ROPE_TYPES[rope_type] if k not in (self.rope_scaling or {})]
        if missing:
            raise ModelLoadError(f"rope scaling {rope_type!r} needs {missing}")

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in ARCHITECTURES:
            raise ModelLoadError(
                f"{source}: model_type {model_type!r} is not supported (want one of "
                f"{ARCHITECTURES})"
            )
        # Variants that would change the math are refused rather than ignored.
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported")
        if raw.get("use_sliding_window"):
            raise ModelLoadError(f"{source}: sliding-window attention is not supported")
        mtp_layers = raw.get("num_nextn_predict_layers") or 0
        if mtp_layers not in (0, 1):
            raise ModelLoadError(
                f"{source}: num_nextn_predict_layers {mtp_layers!r} is not supported (0 or 1)"
            )
        try:
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            rope_theta, rope_scaling = _rope_settings(raw)
            eos = raw.get("eos_token_id")
            eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
            return cls(
                arch=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                # Qwen2 always has q/k/v biases and none on o_proj; Llama has
                # `attention_bias` on all four projections.
                qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
                o_bias=model_type == "llama" and bool(raw.get("attention_bias", False)),
                mlp_bias=model_type == "llama" and bool(raw.get("mlp_bias", False)),
                eos_token_ids=eos_ids,
                num_mtp_layers=int(mtp_layers),
            )
        except KeyError as missing:
            raise ModelLoadError(f"{source}: missing field {missing.args[0]!r}") from None
        except (TypeError, ValueError) as bad:
            if isinstance(bad, ModelLoadError):
                raise ModelLoadError(f"{source}: {bad}") from None
            raise ModelLoadError(f"{source}: bad value: {bad}") from None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not Path(model_dir).is_dir():
            raise ModelLoadError(f"model directory {model_dir} does not exist")
        if not path.is_file():
            raise ModelLoadError(f"{path}: no config.json in the model directory")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as bad:
            raise ModelLoadError(f"{path}: cannot read JSON: {bad}") from None
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{path}: expected a JSON object")
        return cls.from_dict(raw, str(path))


def _rope_settings(raw: dict) -> tuple[float, dict | None]:
    params = raw.get("rope_parameters")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        if scaling.get("rope_type", "default") == "default":
            scaling = None
        return theta, scaling
    scaling = raw.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise ModelLoadError(f"rope_scaling must be an object, got {scaling!r}")
    if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return float(raw.get("rope_theta", 10000.0)), scaling
