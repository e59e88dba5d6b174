"""Building a rank's engine for an MLA-family model (GLM-5, DeepSeek-V3.2, V3).

`kvrelay.model.loader.load_engine` hands these model types here; the
engine, its admission, prefix cache, chunked prefill, CP split and
speculative decoding are the same as for Llama/Qwen2, over a
`LatentKVPool` and an `MlaDecoderShard`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvrelay.layout import LayoutError, ModelKVSpec, ParallelConfig, rank_rectangle
from kvrelay.model.comm import Comm
from kvrelay.model.config import TORCH_DTYPES
from kvrelay.model.engine import Engine
from kvrelay.model.errors import ModelLoadError
from kvrelay.model.latent_pool import LatentKVPool
from kvrelay.model.mla_config import MLA_ARCHITECTURES, MlaConfig
from kvrelay.model.mla_decoder import MlaDecoderShard
from kvrelay.model.mla_weights import MlaShardPlan, load_mla_weights
from kvrelay.model.weights import fingerprint


def is_mla_model(model_dir: str | Path) -> bool:
    """Whether `model_dir`'s config.json names a model type of this family."""
    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False  # ModelConfig.from_dir reports what is wrong
    return isinstance(raw, dict) and raw.get("model_type") in MLA_ARCHITECTURES


def mla_config_from_dir(model_dir: str | Path) -> MlaConfig:
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as bad:
        raise ModelLoadError(f"{path}: cannot read JSON: {bad}") from None
    return MlaConfig.from_dict(raw, str(path))


def mla_kv_spec(
    model_dir: str | Path, config: MlaConfig, dtype: str, page_size: int, key_scheme="kvrelay"
) -> ModelKVSpec:
    """The unified page of this model: one latent head per layer
    (kv_lora_rank + qk_rope_head_dim wide), the indexer keys of the layers
    whose indexer runs after it, in the model dtype (transformers keeps them
    so)."""
    indexed = config.has_indexer
    return ModelKVSpec(
        model_id=f"{config.arch}:{Path(model_dir).resolve().name}",
        weights_fingerprint=fingerprint(model_dir),
        num_layers=config.num_layers,
        num_kv_heads=1,
        k_head_dim=config.latent_dim,
        v_head_dim=0,
        kv_dtype=dtype,
        attention_kind="mla",
        page_size=page_size,
        key_scheme=key_scheme,
        rope_head_dim=config.qk_rope_head_dim,
        index_head_dim=config.index_head_dim if indexed else 0,
        index_layers=config.index_layers,
        index_topk=config.index_topk if indexed else 0,
    )


def mla_shard_plan(config: MlaConfig, spec: ModelKVSpec, parallel: ParallelConfig) -> MlaShardPlan:
    """Heads and columns of `parallel`'s TP rank, layers of its PP stage (the
    stage's rectangle of the unified page: one latent head, all TP ranks
    hold it, the first writes it)."""
    rect = rank_rectangle(spec, parallel)
    return MlaShardPlan.split(
        config,
        parallel.tp,
        parallel.tp_rank,
        (rect.layer_start, rect.layer_end),
        parallel.pp_rank == 0,
        parallel.pp_rank == parallel.pp - 1,
    )


def latent_pool_for(
    config: MlaConfig, layers: tuple[int, int], num_pages, page_size, dtype, device
):
    """A pool for global layers [start, end), with indexer keys where they run."""
    start, end = layers
    local = tuple(i - start for i in config.index_layers if start <= i < end)
    return LatentKVPool(
        num_pages=num_pages,
        page_size=page_size,
        num_layers=end - start,
        latent_dim=config.latent_dim,
        index_dim=config.index_head_dim if local else 0,
        index_local_layers=local,
        dtype=dtype,
        device=device,
    )


def load_mla_engine(
    model_dir: str | Path,
    *,
    dtype: str,
    page_size: int,
    num_pages: int,
    parallel: ParallelConfig,
    comm: Comm | None,
    device: torch.device,
    max_prefill_tokens: int,
    speculative: int = 0,
    mtp_positions: str = "target",
    key_scheme: str = "kvrelay",
) -> Engine:
    config = mla_config_from_dir(model_dir)
    try:
        spec = mla_kv_spec(model_dir, config, dtype, page_size, key_scheme)
        plan = mla_shard_plan(config, spec, parallel)
    except LayoutError as exc:
        raise ModelLoadError(str(exc)) from exc
    torch_dtype = TORCH_DTYPES[dtype]
    weights = load_mla_weights(model_dir, config, plan, torch_dtype, device)
    layers = (plan.layer_start, plan.layer_end)
    pool = latent_pool_for(config, layers, num_pages, page_size, torch_dtype, device)
    draft = None
    if speculative:
        from kvrelay.model.mla_mtp import load_mla_draft

        draft = load_mla_draft(
            model_dir, config, spec, plan, torch_dtype, (num_pages, page_size), comm,
            mtp_positions, device, speculative,
        )  # fmt: skip
    shard = MlaDecoderShard(config, plan, weights, pool, comm)
    return Engine(shard, spec, parallel, max_prefill_tokens, draft)
