"""Loading a rank's share of a Hugging Face checkpoint from safetensors files.

A directory holds `model.safetensors`, or shards listed by
`model.safetensors.index.json`, or any `*.safetensors` files. Each rank reads
only the slices it owns (`safe_open(...).get_slice`): its query/KV heads and
MLP columns under TP, its layers under PP. Every tensor's shape is checked
against the config before it is sliced; errors name the file and tensor.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kvrelay.model.config import ModelConfig
from kvrelay.model.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """Which part of the model one rank holds.

    Query heads [q_head_start, +num_q_heads), KV heads [kv_head_start,
    +num_kv_heads) (a replicated head when TP exceeds the KV heads), MLP
    columns [mlp_start, +mlp_size), layers [layer_start, layer_end).
    """

    q_head_start: int
    num_q_heads: int
    kv_head_start: int
    num_kv_heads: int
    mlp_start: int
    mlp_size: int
    layer_start: int
    layer_end: int
    first_stage: bool
    last_stage: bool

    @classmethod
    def whole(cls, config: ModelConfig) -> ShardPlan:
        return cls(
            0,
            config.num_heads,
            0,
            config.num_kv_heads,
            0,
            config.intermediate_size,
            0,
            config.num_layers,
            True,
            True,
        )


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    q_proj: torch.Tensor
    k_proj: torch.Tensor
    v_proj: torch.Tensor
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    o_proj: torch.Tensor
    o_bias: torch.Tensor | None  # added once, after the TP all-reduce
    post_norm: torch.Tensor
    gate_proj: torch.Tensor
    up_proj: torch.Tensor
    down_proj: torch.Tensor
    gate_bias: torch.Tensor | None
    up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None  # added once, after the TP all-reduce


@dataclass(slots=True)
class ModelWeights:
    embed: torch.Tensor | None  # first stage only
    layers: list[LayerWeights]
    final_norm: torch.Tensor | None  # last stage only
    lm_head: torch.Tensor | None  # last stage only (the embedding when tied)


def weight_files(model_dir: str | Path) -> dict[str, Path]:
    """Tensor name -> file holding it, from the index or by opening every file."""
    root = Path(model_dir)
    if not root.is_dir():
        raise ModelLoadError(f"model directory {root} does not exist")
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as bad:
            raise ModelLoadError(f"{index}: not a safetensors index ({bad})") from None
        located = {name: root / file for name, file in weight_map.items()}
        for file in set(located.values()):
            if not file.is_file():
                raise ModelLoadError(f"{index}: lists {file.name}, which does not exist")
        return located
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{root}: no *.safetensors files in the model directory")
    located = {}
    for file in files:
        for name in _open(file).keys():  # noqa: SIM118 (a safe_open handle, not a dict)
            located[name] = file
    return located


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as bad:
        raise ModelLoadError(f"{file}: not a readable safetensors file ({bad})") from None


def fingerprint(model_dir: str | Path) -> str:
    """sha256 of the weight files' bytes, in name order: two directories with the
    same weights share KV pages, any change of a weight is a different namespace."""
    digest = hashlib.sha256()
    for file in sorted(set(weight_files(model_dir).values())):
        digest.update(file.name.encode())
        with file.open("rb") as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
    return "sha256:" + digest.hexdigest()


class _Reader:
    """Reads (slices of) named tensors, checking their full shapes first."""

    def __init__(
        self, model_dir: str | Path, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> None:
        self.files = weight_files(model_dir)
        self.dtype = dtype
        self.device = torch.device(device)
        self._handles: dict[Path, object] = {}

    def read(self, name: str, shape: tuple[int, ...], rows=None, cols=None) -> torch.Tensor:
        file = self.files.get(name)
        if file is None:
            raise ModelLoadError(f"missing tensor {name!r} in the checkpoint ({self._where()})")
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = _open(file)
        try:
            piece = handle.get_slice(name)
        except (SafetensorError, KeyError) as bad:
            raise ModelLoadError(f"{file}: cannot read tensor {name!r} ({bad})") from None
        found = tuple(piece.get_shape())
        if found != shape:
            raise ModelLoadError(f"{file}: tensor {name!r} has shape {found}, config says {shape}")
        rows = rows or (0, shape[0])
        if len(shape) == 1:
            tensor = piece[rows[0] : rows[1]]
        else:
            cols = cols or (0, shape[1])
            tensor = piece[rows[0] : rows[1], cols[0] : cols[1]]
        return tensor.to(device=self.device, dtype=self.dtype).contiguous()

    def _where(self) -> str:
        files = sorted({f.name for f in self.files.values()})
        return "files: " + ", ".join(files)


def load_weights(
    model_dir: str | Path,
    config: ModelConfig,
    plan: ShardPlan,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> ModelWeights:
    """The tensors `plan`'s rank needs, in `dtype`, on `device`."""
    reader = _Reader(model_dir, dtype, device)
    hidden = config.hidden_size
    layers = [
        read_layer(reader, config, plan, index) for index in range(plan.layer_start, plan.layer_end)
    ]
    embed_shape = (config.vocab_size, hidden)
    embed = lm_head = final_norm = None
    if plan.first_stage:
        embed = reader.read("model.embed_tokens.weight", embed_shape)
    if plan.last_stage:
        final_norm = reader.read("model.norm.weight", (hidden,))
        if config.tie_word_embeddings:
            # Tied: the head is the embedding (a stored lm_head.weight is ignored).
            if embed is None:
                lm_head = reader.read("model.embed_tokens.weight", embed_shape)
            else:
                lm_head = embed
        else:
            lm_head = reader.read("lm_head.weight", embed_shape)
    return ModelWeights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)


def read_layer(reader: _Reader, config: ModelConfig, plan: ShardPlan, index: int) -> LayerWeights:
    """Decoder layer `index`'s tensors (its `model.layers.{index}.*`), `plan`'s
    heads and MLP columns of them."""
    hidden, hd, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q_out, kv_out = config.num_heads * hd, config.num_kv_heads * hd
    q_rows = (plan.q_head_start * hd, (plan.q_head_start + plan.num_q_heads) * hd)
    kv_rows = (plan.kv_head_start * hd, (plan.kv_head_start + plan.num_kv_heads) * hd)
    mlp_rows = (plan.mlp_start, plan.mlp_start + plan.mlp_size)
    p = f"model.layers.{index}."
    attn, mlp = p + "self_attn.", p + "mlp."

    def bias(name: str, size: int, rows=None) -> torch.Tensor:
        return reader.read(name, (size,), rows)

    def mlp_bias(name: str, size: int, rows=None) -> torch.Tensor | None:
        return bias(mlp + name, size, rows) if config.mlp_bias else None

    def qkv_bias(name: str, size: int, rows) -> torch.Tensor | None:
        return bias(attn + name, size, rows) if config.qkv_bias else None

    return LayerWeights(
        input_norm=reader.read(p + "input_layernorm.weight", (hidden,)),
        q_proj=reader.read(attn + "q_proj.weight", (q_out, hidden), q_rows),
        k_proj=reader.read(attn + "k_proj.weight", (kv_out, hidden), kv_rows),
        v_proj=reader.read(attn + "v_proj.weight", (kv_out, hidden), kv_rows),
        q_bias=qkv_bias("q_proj.bias", q_out, q_rows),
        k_bias=qkv_bias("k_proj.bias", kv_out, kv_rows),
        v_bias=qkv_bias("v_proj.bias", kv_out, kv_rows),
        o_proj=reader.read(attn + "o_proj.weight", (hidden, q_out), None, q_rows),
        o_bias=bias(attn + "o_proj.bias", hidden) if config.o_bias else None,
        post_norm=reader.read(p + "post_attention_layernorm.weight", (hidden,)),
        gate_proj=reader.read(mlp + "gate_proj.weight", (inter, hidden), mlp_rows),
        up_proj=reader.read(mlp + "up_proj.weight", (inter, hidden), mlp_rows),
        down_proj=reader.read(mlp + "down_proj.weight", (hidden, inter), None, mlp_rows),
        gate_bias=mlp_bias("gate_proj.bias", inter, mlp_rows),
        up_bias=mlp_bias("up_proj.bias", inter, mlp_rows),
        down_bias=mlp_bias("down_proj.bias", hidden),
    )
