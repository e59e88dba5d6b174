"""SGLang's model, rank and page keys, seen as kvrelay's unified layout.

Read from the host pool SGLang registers (`MHATokenToKVPoolHost` or
`MLATokenToKVPoolHost`, duck-typed: nothing here imports SGLang) and from its
`HiCacheStorageConfig`:

* the model's `ModelKVSpec` (its namespace digest names every page);
* the rank's rectangle: its KV heads (TP) and its PP stage's layers
  [start_layer, start_layer + target layers);
* page keys: SGLang's own key is a sha256 chain over the tokens of each page
  (hex; seeded by its per-request namespace seed when a request has an
  extra_key or cache_salt); kvrelay keeps it, rooted in the model namespace,
  as the "sglang" key scheme does (`kvrelay.layout.keys`): a kvrelay worker
  whose spec has `key_scheme="sglang"` computes the same keys from token ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvrelay.layout import KV_DTYPE_ITEMSIZE, LayoutError, ModelKVSpec, Rectangle
from kvrelay.layout.keys import sglang_chain, sglang_page_key


class UnsupportedPool(ValueError):
    """A host pool or storage config the adapter cannot map onto unified pages."""


@dataclass(frozen=True, slots=True)
class PoolGeometry:
    """What one rank's SGLang host pool holds, in kvrelay's terms."""

    attention_kind: str  # "mha" or "mla"
    layout: str
    local_heads: int
    local_layers: int  # the target model's layers only (packed draft layers excluded)
    start_layer: int
    k_head_dim: int  # MLA: the latent + rope row
    v_head_dim: int  # 0 for MLA
    kv_dtype: str
    page_size: int
    heads_per_group: int = 1  # page_unified's head grouping
    rope_head_dim: int = 0  # MLA: the RoPE part of the latent row
    # MLA: SGLang rotates the RoPE part as interleaved pairs (DeepSeek's
    # `rope_interleave`) and caches it so; unified pages hold it as the
    # runner and transformers do, evens then odds (`rope_order`).
    rope_pairs: bool = False


def pool_geometry(pool, rope_interleave: bool = True) -> PoolGeometry:
    """Geometry of a registered SGLang host pool; refuses pools with no unified form.
    `rope_interleave`: the model's (DeepSeek's default), for MLA pools."""
    dtype = str(pool.dtype).removeprefix("torch.")
    if dtype not in KV_DTYPE_ITEMSIZE:
        raise UnsupportedPool(f"host pool dtype {pool.dtype} has no kvrelay KV dtype")
    if getattr(pool, "dcp_size", 1) != 1:
        raise UnsupportedPool("decode context parallel (dcp_size > 1) pools are not supported")
    layers = int(getattr(pool, "target_layer_num", pool.layer_num))
    if hasattr(pool, "kv_cache_dim"):  # MLA: one latent row per token and layer
        width, rope = int(pool.kv_cache_dim), int(getattr(pool, "qk_rope_head_dim", 0))
        if width != int(getattr(pool, "kv_lora_rank", 0)) + rope:
            rope = 0  # a packed (quantized) row: no RoPE part to name
        return PoolGeometry(
            "mla", pool.layout, 1, layers, int(pool.start_layer), width, 0,
            dtype, int(pool.page_size), rope_head_dim=rope,
            rope_pairs=bool(rope) and rope_interleave,
        )  # fmt: skip
    if pool.v_head_dim != pool.head_dim:
        raise UnsupportedPool("K and V head dims differ (asymmetric MHA host pools)")
    grouping = getattr(pool, "page_unified_layout", None)
    return PoolGeometry(
        "mha", pool.layout, int(pool.head_num), layers, int(pool.start_layer),
        int(pool.head_dim), int(pool.v_head_dim), dtype, int(pool.page_size),
        grouping.heads_per_group if grouping is not None else 1,
    )  # fmt: skip


def model_spec(config, storage_config, geometry: PoolGeometry) -> ModelKVSpec:
    """The model's spec: identity from the extra config, geometry from the pool.

    Global counts come from the extra config when given; otherwise a rank that
    holds every layer (PP=1) supplies the layer count, and TP ranks the heads
    (local heads x TP, valid while TP does not exceed the KV heads).
    """
    model_id = config.model_id or (storage_config.model_name or "")
    if not model_id:
        raise UnsupportedPool("no model identity: set model_id in the extra config")
    if config.num_layers is not None:
        layers = config.num_layers
    elif storage_config.pp_size == 1:
        layers = geometry.local_layers
    else:
        raise UnsupportedPool("with pp_size > 1 the extra config must give num_layers")
    if geometry.attention_kind == "mla":
        heads = 1
    else:
        heads = config.num_kv_heads or geometry.local_heads * storage_config.tp_size
    return ModelKVSpec(
        model_id=model_id,
        weights_fingerprint=config.weights_fingerprint,
        num_layers=layers,
        num_kv_heads=heads,
        k_head_dim=geometry.k_head_dim,
        v_head_dim=geometry.v_head_dim,
        kv_dtype=geometry.kv_dtype,
        attention_kind=geometry.attention_kind,
        page_size=geometry.page_size,
        salt=config.salt,
        key_scheme="sglang",
        rope_head_dim=geometry.rope_head_dim,
    )


def rank_rectangle(spec: ModelKVSpec, storage_config, geometry: PoolGeometry) -> Rectangle:
    """Heads x layers this rank holds; `writer` is False for replicas that only read.

    MLA's one latent head is replicated on every TP rank: only the storage
    writer SGLang names (TP rank 0) writes it. MHA heads split over TP; past
    the KV head count each head is replicated and its first replica writes.
    """
    if storage_config.attn_cp_size > 1 or storage_config.dcp_size > 1:
        raise UnsupportedPool("attention context parallel ranks hold partial pages: unsupported")
    tp, tp_rank = storage_config.tp_size, storage_config.tp_rank
    if spec.attention_kind == "mla":
        h0, h1, writer = 0, 1, bool(storage_config.is_storage_writer)
    elif tp <= spec.num_kv_heads:
        if spec.num_kv_heads % tp:
            raise UnsupportedPool(f"tp_size {tp} does not divide {spec.num_kv_heads} KV heads")
        per_rank = spec.num_kv_heads // tp
        h0, h1, writer = tp_rank * per_rank, (tp_rank + 1) * per_rank, True
    else:
        if tp % spec.num_kv_heads:
            raise UnsupportedPool(f"tp_size {tp} is not a multiple of {spec.num_kv_heads} heads")
        replicas = tp // spec.num_kv_heads
        h0 = tp_rank // replicas
        h1, writer = h0 + 1, tp_rank % replicas == 0
    if h1 - h0 != geometry.local_heads:
        raise UnsupportedPool(
            f"the pool holds {geometry.local_heads} KV heads, the rank's share of "
            f"{spec.num_kv_heads} heads at tp_size {tp} is {h1 - h0}: set num_kv_heads"
        )
    l0 = geometry.start_layer
    try:
        rect = Rectangle(h0, h1, l0, l0 + geometry.local_layers, writer)
        rect.check_inside(spec)
    except LayoutError as exc:
        raise UnsupportedPool(f"rank rectangle outside the model: {exc}") from exc
    return rect


def kvrelay_key(namespace: bytes, sglang_key: str) -> bytes:
    """The kvrelay page key of one SGLang page key (a sha256 hex digest)."""
    try:
        digest = bytes.fromhex(sglang_key)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"SGLang page key {sglang_key!r} is not a hex digest") from exc
    return sglang_page_key(namespace, digest)


def sglang_page_keys(tokens: Sequence[int], page_size: int, seed: str | None = None) -> list[str]:
    """SGLang's storage keys (hex) of the full pages of `tokens`: its chain
    (`kvrelay.layout.keys.sglang_chain`) from the request's namespace seed."""
    prior = bytes.fromhex(seed) if seed else b""
    return [link.hex() for link in sglang_chain(tokens, page_size, prior)]


def rope_to_unified(rows, rope: int) -> None:
    """Latent rows [..., width] in place: the trailing `rope` values from
    interleaved pairs (SGLang's cache) to evens then odds (unified pages)."""
    tail = rows[..., -rope:].clone()
    rows[..., -rope:] = torch.cat([tail[..., 0::2], tail[..., 1::2]], dim=-1)


def rope_to_pairs(rows, rope: int) -> None:
    """The inverse of `rope_to_unified`, in place."""
    width, half = rows.size(-1), rope // 2
    tail = rows[..., -rope:].clone()
    rows[..., width - rope :: 2] = tail[..., :half]
    rows[..., width - rope + 1 :: 2] = tail[..., half:]
