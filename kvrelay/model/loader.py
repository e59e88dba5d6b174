"""Building a rank's engine from a model directory and a parallel config."""

from __future__ import annotations

from pathlib import Path

import torch

from kvrelay.layout import (
    DEFAULT_PAGE_SIZE,
    LayoutError,
    ModelKVSpec,
    ParallelConfig,
    rank_rectangle,
)
from kvrelay.model.comm import Comm
from kvrelay.model.config import TORCH_DTYPES, ModelConfig
from kvrelay.model.decoder import DecoderShard
from kvrelay.model.device import parse_device
from kvrelay.model.engine import DEFAULT_MAX_PREFILL_TOKENS, Engine
from kvrelay.model.errors import ModelLoadError
from kvrelay.model.mla_config import MlaConfig
from kvrelay.model.mla_loader import (
    is_mla_model,
    load_mla_engine,
    mla_config_from_dir,
    mla_kv_spec,
)
from kvrelay.model.mtp import MtpLayer, draft_kv_spec, load_mtp_weights
from kvrelay.model.paged_attention import DEFAULT_CHUNK_TOKENS, PagedOnlineSoftmaxBackend
from kvrelay.model.pool import PagedKVPool
from kvrelay.model.speculative import SpecDecoder
from kvrelay.model.weights import ShardPlan, fingerprint, load_weights


def kv_spec(
    model_dir: str | Path, config: ModelConfig, dtype: str, page_size: int, key_scheme="kvrelay"
) -> ModelKVSpec:
    """The unified page identity of this model's KV: the directory's name as
    model id, the weight files' digest as fingerprint; `key_scheme` "sglang"
    keys pages as SGLang's HiCache adapter does (`kvrelay.layout.keys`)."""
    return ModelKVSpec(
        model_id=f"{config.arch}:{Path(model_dir).resolve().name}",
        weights_fingerprint=fingerprint(model_dir),
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        k_head_dim=config.head_dim,
        v_head_dim=config.head_dim,
        kv_dtype=dtype,
        page_size=page_size,
        key_scheme=key_scheme,
    )


def load_config(model_dir: str | Path) -> ModelConfig | MlaConfig:
    """The model's config, whichever family (Llama/Qwen2 or the MLA family)."""
    if is_mla_model(model_dir):
        return mla_config_from_dir(model_dir)
    return ModelConfig.from_dir(model_dir)


def model_kv_spec(
    model_dir: str | Path, dtype: str, page_size: int, key_scheme: str = "kvrelay"
) -> ModelKVSpec:
    """The unified page spec of the model in `model_dir`, whichever family."""
    if is_mla_model(model_dir):
        return mla_kv_spec(model_dir, mla_config_from_dir(model_dir), dtype, page_size, key_scheme)
    return kv_spec(model_dir, ModelConfig.from_dir(model_dir), dtype, page_size, key_scheme)


def shard_plan(config: ModelConfig, spec: ModelKVSpec, parallel: ParallelConfig) -> ShardPlan:
    """Heads, MLP columns and layers of `parallel`'s rank; KV heads and layers
    are exactly its rectangle of the unified page (DESIGN.md section 3)."""
    tp = parallel.tp
    if config.num_heads % tp:
        raise ModelLoadError(f"tp={tp} does not divide {config.num_heads} attention heads")
    if config.intermediate_size % tp:
        raise ModelLoadError(
            f"tp={tp} does not divide intermediate_size {config.intermediate_size}"
        )
    rect = rank_rectangle(spec, parallel)
    q_per_rank = config.num_heads // tp
    mlp_per_rank = config.intermediate_size // tp
    return ShardPlan(
        q_head_start=parallel.tp_rank * q_per_rank,
        num_q_heads=q_per_rank,
        kv_head_start=rect.head_start,
        num_kv_heads=rect.num_heads,
        mlp_start=parallel.tp_rank * mlp_per_rank,
        mlp_size=mlp_per_rank,
        layer_start=rect.layer_start,
        layer_end=rect.layer_end,
        first_stage=parallel.pp_rank == 0,
        last_stage=parallel.pp_rank == parallel.pp - 1,
    )


def load_engine(
    model_dir: str | Path,
    *,
    dtype: str = "float32",
    page_size: int = DEFAULT_PAGE_SIZE,
    num_pages: int = 256,
    parallel: ParallelConfig | None = None,
    comm: Comm | None = None,
    device: torch.device | str = "cpu",
    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
    attention_chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    speculative: int = 0,
    mtp_positions: str = "target",
    key_scheme: str = "kvrelay",
    batch_invariant_attention: bool = False,
) -> Engine:
    """An engine for one rank (the whole model when `parallel` is None), its
    weights, KV pool and activations on `device`; `speculative` K > 0 drafts
    K tokens per step with the model's MTP layer; `key_scheme` names how page
    keys derive from tokens (`kvrelay.layout.keys`); `batch_invariant_attention`
    makes a row's attention bits independent of the forward's other rows, so
    pages are byte-identical whatever CP degree computed them
    (`kvrelay.model.paged_attention`). Models of the MLA family (GLM-5,
    DeepSeek-V3.2, DeepSeek-V3) load through `kvrelay.model.mla_loader`
    over a `LatentKVPool`; `attention_chunk_tokens` and
    `batch_invariant_attention` do not apply to them (their pages under CP
    equal CP=1's to rounding, not byte for byte)."""
    if dtype not in TORCH_DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not one of {sorted(TORCH_DTYPES)}")
    parallel = parallel or ParallelConfig()
    if not isinstance(speculative, int) or speculative < 0:
        raise ModelLoadError(f"speculative must be a non-negative int, got {speculative!r}")
    if is_mla_model(model_dir):
        return load_mla_engine(
            model_dir, dtype=dtype, page_size=page_size, num_pages=num_pages, parallel=parallel,
            comm=comm, device=parse_device(device), max_prefill_tokens=max_prefill_tokens,
            speculative=speculative, mtp_positions=mtp_positions, key_scheme=key_scheme,
        )  # fmt: skip
    config = ModelConfig.from_dir(model_dir)
    try:
        spec = kv_spec(model_dir, config, dtype, page_size, key_scheme)
    except LayoutError as exc:
        raise ModelLoadError(str(exc)) from exc
    plan = shard_plan(config, spec, parallel)
    torch_dtype = TORCH_DTYPES[dtype]
    device = parse_device(device)
    weights = load_weights(model_dir, config, plan, torch_dtype, device)
    pool = PagedKVPool(
        num_pages=num_pages, page_size=page_size, num_layers=plan.layer_end - plan.layer_start,
        num_heads=plan.num_kv_heads, head_dim=config.head_dim, dtype=torch_dtype, device=device,
    )  # fmt: skip
    draft = None
    if speculative:
        shape = (num_pages, page_size)
        draft = load_draft(model_dir, config, plan, torch_dtype, shape, comm, mtp_positions, device)
        draft = SpecDecoder(draft, draft_kv_spec(spec, config, mtp_positions), speculative)
    backend = PagedOnlineSoftmaxBackend(attention_chunk_tokens, batch_invariant_attention)
    shard = DecoderShard(config, plan, weights, pool, comm, backend)
    return Engine(shard, spec, parallel, max_prefill_tokens, draft)


def load_draft(
    model_dir, config, plan, dtype, geometry, comm, positions, device
) -> MtpLayer | None:
    """The MTP layer of the last PP stage's ranks (None on other stages), with
    a draft pool of as many pages as the target's."""
    if config.num_mtp_layers < 1:
        raise ModelLoadError(
            f"{model_dir}: --speculative needs an MTP layer (num_nextn_predict_layers)"
        )
    if not plan.last_stage:
        return None
    pool = PagedKVPool(
        num_pages=geometry[0],
        page_size=geometry[1],
        num_layers=1,
        num_heads=plan.num_kv_heads,
        head_dim=config.head_dim,
        dtype=dtype,
        device=device,
    )
    weights = load_mtp_weights(model_dir, config, plan, dtype, device)
    return MtpLayer(config, plan, weights, pool, comm, positions)
