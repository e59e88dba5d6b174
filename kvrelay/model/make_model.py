"""`kvrelay make-model`: a random Llama or Qwen2 model in Hugging Face format.

Writes `config.json`, a byte-level `tokenizer.json` with a chat template
(`tokenizer_files.py`; vocabularies of 256 or more) and the weights as
safetensors (one file, or shards with a `model.safetensors.index.json`),
loadable by this runner and by transformers alike. Weights are N(0, std)
with std 0.05 by default, large enough that greedy decoding of a tiny model
does not settle into a short loop that would hide errors; norm weights are
1 + N(0, 0.1) so they are exercised.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvrelay.model.config import TORCH_DTYPES
from kvrelay.model.tokenizer_files import write_tokenizer


@dataclass(frozen=True, slots=True)
class RandomModelSpec:
    arch: str = "llama"
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 256
    intermediate: int | None = None  # default: 2 x hidden
    head_dim: int | None = None  # default: hidden / heads
    tie_embeddings: bool = False
    attention_bias: bool = False  # Llama only (Qwen2 always has q/k/v biases)
    mlp_bias: bool = False  # Llama only
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_positions: int = 16384
    std: float = 0.05
    seed: int = 0
    dtype: str = "float32"
    shards: int = 1
    mtp: int = 0  # MTP layers (DeepSeek-V3 layout after the decoder layers): 0 or 1
    # "random", or "copy": the MTP layer is built from the target's first
    # layer (see `copy_target_layer`), a draft that agrees with a one-layer target.
    mtp_init: str = "random"

    def config_json(self) -> dict:
        head_dim = self.head_dim or self.hidden // self.heads
        config = {
            "architectures": ["LlamaForCausalLM" if self.arch == "llama" else "Qwen2ForCausalLM"],
            "model_type": self.arch,
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate or 2 * self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_positions,
            "rms_norm_eps": 1e-6,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_embeddings,
            "torch_dtype": self.dtype,
            "bos_token_id": None,
            "eos_token_id": None,
            "pad_token_id": None,
        }
        if self.mtp:
            config["num_nextn_predict_layers"] = self.mtp
        if self.arch == "llama":
            config |= {"attention_bias": self.attention_bias, "mlp_bias": self.mlp_bias}
        else:
            config |= {"use_sliding_window": False, "sliding_window": None}
        return config


# A random model's shape flags (RandomModelSpec fields), shared by
# `make-model` and the benches that write a model of their own.
SHAPE_FIELDS = ("layers", "hidden", "heads", "kv_heads", "vocab")


def add_shape_arguments(parser, defaults: dict | None = None) -> None:
    """--layers, --hidden, --heads, --kv-heads, --vocab on an argparse
    parser: required, or with the caller's `defaults` (field -> value)."""
    for field in SHAPE_FIELDS:
        flag = "--" + field.replace("_", "-")
        if defaults is None:
            parser.add_argument(flag, type=int, required=True)
        else:
            parser.add_argument(flag, type=int, default=defaults[field])


def shape_spec(args, **fields) -> RandomModelSpec:
    """The random model of `args`' shape flags, with the other `fields`."""
    return RandomModelSpec(**{f: getattr(args, f) for f in SHAPE_FIELDS}, **fields)


def random_weights(spec: RandomModelSpec) -> dict[str, torch.Tensor]:
    hidden = spec.hidden
    gen = torch.Generator().manual_seed(spec.seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * spec.std

    def norm() -> torch.Tensor:
        return 1 + torch.randn(hidden, generator=gen, dtype=torch.float64) * 0.1

    tensors = {"model.embed_tokens.weight": normal(spec.vocab, hidden)}
    for layer in range(spec.layers):
        tensors |= _layer_tensors(spec, f"model.layers.{layer}.", normal, norm)
    tensors["model.norm.weight"] = norm()
    if not spec.tie_embeddings:
        tensors["lm_head.weight"] = normal(spec.vocab, hidden)
    if spec.mtp:
        # Drawn after the target's tensors, so the target is the same model
        # with or without an MTP layer.
        p = f"model.layers.{spec.layers}."
        tensors |= _layer_tensors(spec, p, normal, norm)
        tensors |= {
            p + "enorm.weight": norm(),
            p + "hnorm.weight": norm(),
            p + "eh_proj.weight": normal(hidden, 2 * hidden),
            p + "shared_head.norm.weight": norm(),
        }
        if spec.mtp_init == "copy":
            tensors |= copy_target_layer(tensors, spec.layers)
    dtype = TORCH_DTYPES[spec.dtype]
    return {name: t.to(dtype).contiguous() for name, t in tensors.items()}


def copy_target_layer(tensors: dict, layers: int) -> dict[str, torch.Tensor]:
    """MTP tensors that make the layer re-run the target's first decoder layer
    one token ahead: eh_proj passes the normed embedding through and drops h,
    enorm scales it back to the embeddings' mean RMS (the target's residual
    starts from the raw embedding), the decoder layer is layer 0's copy and
    shared_head.norm is the target's final norm. The MTP slot i (token i + 1,
    rotated at position i: relative positions are unchanged) then computes
    what a one-layer target computes at position i + 1, short of attending to
    token 0, and its argmax is mostly the target's next token (measured: about
    85% of single proposals accepted on new prompts; deeper targets are not
    emulated by one layer). The random draws stay, so the target's tensors do
    not change."""
    p, src = f"model.layers.{layers}.", "model.layers.0."
    out = {p + n[len(src) :]: t.clone() for n, t in tensors.items() if n.startswith(src)}
    embed = tensors["model.embed_tokens.weight"].to(torch.float64)
    hidden = embed.size(1)
    out[p + "enorm.weight"] = torch.full((hidden,), float(embed.pow(2).mean(-1).sqrt().mean()))
    out[p + "hnorm.weight"] = torch.ones(hidden, dtype=torch.float64)
    out[p + "eh_proj.weight"] = torch.cat(
        [torch.eye(hidden, dtype=torch.float64), torch.zeros(hidden, hidden, dtype=torch.float64)],
        1,
    )
    out[p + "shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
    return out


def _layer_tensors(spec: RandomModelSpec, p: str, normal, norm) -> dict[str, torch.Tensor]:
    config = spec.config_json()
    hidden, inter, hd = spec.hidden, config["intermediate_size"], config["head_dim"]
    tensors: dict[str, torch.Tensor] = {}
    a = p + "self_attn."
    tensors |= {
        p + "input_layernorm.weight": norm(),
        a + "q_proj.weight": normal(spec.heads * hd, hidden),
        a + "k_proj.weight": normal(spec.kv_heads * hd, hidden),
        a + "v_proj.weight": normal(spec.kv_heads * hd, hidden),
        a + "o_proj.weight": normal(hidden, spec.heads * hd),
        p + "post_attention_layernorm.weight": norm(),
        p + "mlp.gate_proj.weight": normal(inter, hidden),
        p + "mlp.up_proj.weight": normal(inter, hidden),
        p + "mlp.down_proj.weight": normal(hidden, inter),
    }
    if spec.arch == "qwen2" or spec.attention_bias:
        tensors |= {
            a + "q_proj.bias": normal(spec.heads * hd),
            a + "k_proj.bias": normal(spec.kv_heads * hd),
            a + "v_proj.bias": normal(spec.kv_heads * hd),
        }
    if spec.arch == "llama" and spec.attention_bias:
        tensors[a + "o_proj.bias"] = normal(hidden)
    if spec.arch == "llama" and spec.mlp_bias:
        tensors |= {
            p + "mlp.gate_proj.bias": normal(inter),
            p + "mlp.up_proj.bias": normal(inter),
            p + "mlp.down_proj.bias": normal(hidden),
        }
    return tensors


def write_model(directory: str | Path, spec: RandomModelSpec) -> Path:
    """Writes the model into `directory` (created if missing) and returns it."""
    if spec.arch not in ("llama", "qwen2"):
        raise ValueError(f"arch must be llama or qwen2, got {spec.arch!r}")
    if spec.dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(TORCH_DTYPES)}")
    if spec.shards < 1:
        raise ValueError("shards must be >= 1")
    if spec.mtp not in (0, 1):
        raise ValueError("mtp must be 0 or 1")
    if spec.mtp_init not in ("random", "copy"):
        raise ValueError("mtp_init must be random or copy")
    return write_checkpoint(directory, spec.config_json(), spec.vocab, random_weights(spec),
                            spec.shards)  # fmt: skip


def write_checkpoint(directory: str | Path, config: dict, vocab: int, tensors: dict,
                     shards: int) -> Path:  # fmt: skip
    """`config.json`, a byte-level tokenizer and `tensors` in HF's layout
    (`model.safetensors`, or `shards` files and their index) in `directory`
    (created if missing); returns it."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer(root, vocab)  # byte-level; none below 256 tokens
    metadata = {"format": "pt"}
    if shards == 1:
        save_file(tensors, str(root / "model.safetensors"), metadata=metadata)
        return root
    names = list(tensors)
    per_shard = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i * per_shard : (i + 1) * per_shard]
        save_file({n: tensors[n] for n in part}, str(root / file), metadata=metadata)
        weight_map |= dict.fromkeys(part, file)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return root
