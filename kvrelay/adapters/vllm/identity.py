"""The kvrelay namespace and rectangle of a vLLM engine's KV cache.

The geometry comes from vLLM's model and cache configs, the identity from
the connector's config, so a page written by an engine of one TP degree is
found (same key) and read (same bytes, each rank its own heads) by an engine
of another, or by kvrelay's own workers when the identity matches theirs.

An MLA model's page is its latent rows (`kv_lora_rank + qk_rope_head_dim`
per token and layer, one head, no V), the same on every TP rank: rank 0
writes it, every rank reads it. DeepSeek sparse attention's pages add the
indexer's quantized key records (`indexer_blocks`); the connector refuses
DSA models until that path has run on a GPU (vLLM runs DSA on GPUs only).
"""

from __future__ import annotations

import torch

from kvrelay.adapters.vllm.blocks import BlockLayoutError
from kvrelay.adapters.vllm.config import ConnectorConfig, ConnectorConfigError
from kvrelay.adapters.vllm.indexer_blocks import dsa_spec
from kvrelay.layout import ModelKVSpec, ParallelConfig, Rectangle, rank_rectangle

# The KV dtypes a unified page can hold, by torch dtype.
KV_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def engine_spec(config: ConnectorConfig, vllm_config) -> ModelKVSpec:
    """The model's `ModelKVSpec`: one page is one vLLM block."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise ConnectorConfigError("KvrelayConnector runs with pipeline_parallel_size 1 only")
    if cache.cache_dtype not in ("auto", None):
        raise ConnectorConfigError(
            "KvrelayConnector moves the model's own dtype, "
            f"not kv_cache_dtype={cache.cache_dtype!r}"
        )
    dtype = KV_DTYPES.get(model.dtype)
    if dtype is None:
        raise ConnectorConfigError(f"KvrelayConnector cannot move a {model.dtype} KV cache")
    if model.use_mla:
        return _latent_spec(config, vllm_config, dtype)
    head_dim = model.get_head_size()
    return ModelKVSpec(
        model_id=config.model_id or str(model.model),
        weights_fingerprint=config.weights_fingerprint,
        num_layers=model.get_total_num_hidden_layers(),
        num_kv_heads=model.get_total_num_kv_heads(),
        k_head_dim=head_dim,
        v_head_dim=head_dim,
        kv_dtype=dtype,
        page_size=cache.block_size,
        salt=config.salt,
        key_scheme=config.key_scheme,
    )


def _latent_spec(config: ConnectorConfig, vllm_config, dtype: str) -> ModelKVSpec:
    text = vllm_config.model_config.hf_text_config
    if getattr(text, "index_topk", None) is not None:
        # The page layout is built (`indexer_blocks`): named here so the
        # refusal says which namespace the model's pages would take.
        try:
            dsa = dsa_spec(_latent_rows_spec(config, vllm_config, dtype), text)
        except BlockLayoutError as e:
            raise ConnectorConfigError(f"a DeepSeek sparse attention model: {e}") from None
        raise ConnectorConfigError(
            "KvrelayConnector does not move DeepSeek sparse attention (DSA) caches yet: vLLM "
            "runs sparse attention on GPUs only, where this path has not run (its pages "
            f"would be namespace {dsa.namespace().hex()[:16]}, indexer keys as "
            f"{dsa.index_head_dim}-byte fp8 records in layers {list(dsa.index_layers)})"
        )
    _refuse_cpu_rotary_op(vllm_config)
    return _latent_rows_spec(config, vllm_config, dtype)


def _latent_rows_spec(config: ConnectorConfig, vllm_config, dtype: str) -> ModelKVSpec:
    model, cache = vllm_config.model_config, vllm_config.cache_config
    text = model.hf_text_config
    rope = int(text.qk_rope_head_dim)
    width = int(text.kv_lora_rank) + rope
    if model.get_head_size() != width:
        raise ConnectorConfigError(
            f"vLLM caches {model.get_head_size()} values per token, not the latent "
            f"kv_lora_rank + qk_rope_head_dim = {width}"
        )
    return ModelKVSpec(
        model_id=config.model_id or str(model.model),
        weights_fingerprint=config.weights_fingerprint,
        num_layers=model.get_total_num_hidden_layers(),
        num_kv_heads=1,
        k_head_dim=width,
        v_head_dim=0,
        kv_dtype=dtype,
        attention_kind="mla",
        page_size=cache.block_size,
        salt=config.salt,
        key_scheme=config.key_scheme,
        rope_head_dim=rope,
    )


def rank_rect(spec: ModelKVSpec, vllm_config, tp_rank: int) -> Rectangle:
    tp = vllm_config.parallel_config.tensor_parallel_size
    return rank_rectangle(spec, ParallelConfig(tp=tp, pp=1, tp_rank=tp_rank, pp_rank=0))


def _refuse_cpu_rotary_op(vllm_config) -> None:
    """vLLM 0.32's CPU `rotary_embedding` op rotates DeepSeek's k_pe (a
    strided view of kv_a_proj's output) by wrong positions, and past the
    first few tokens of a batch by none: such an engine's pages hold keys no
    other engine would compute, and a shared tier would hand them to every
    reader of the same weights. Its torch-native twin is right."""
    if vllm_config.device_config.device_type != "cpu":
        return
    ops = list(vllm_config.compilation_config.custom_ops or ())
    if "-rotary_embedding" in ops or ("none" in ops and "+rotary_embedding" not in ops):
        return
    raise ConnectorConfigError(
        "KvrelayConnector refuses an MLA model on vLLM's CPU rotary_embedding op, which "
        "misrotates DeepSeek's RoPE keys; start vLLM with "
        '--compilation-config \'{"custom_ops": ["-rotary_embedding"]}\''
    )
