"""SGLang's named host pools (HiCache's v2 storage interface) on kvrelay's pages.

SGLang registers, besides the KV pool, a pool per extra cache a token keeps
(`register_mem_host_pool_v2(pool, name)`). kvrelay holds four of them:

* `kv`: the target's KV (MHA) or latent rows (MLA), the pool v1 moves too;
* `indexer`: the DSA indexer's keys of the target's layers whose indexer
  runs. They join the target's unified page after each such layer's latent
  rows (`ModelKVSpec.index_*`), so a page counts only when latent and keys are
  both in: a missing indexer page shortens the hit as `all_pages` says;
* `draft`: the MTP / EAGLE draft model's KV, in draft pages of their own
  (a draft namespace derived from the target's). SGLang files a draft page
  under its target page's key, as its own backends do, so a draft page's
  last slot (which depends on the next page's first token) is whatever the
  request that wrote it computed: a stale slot costs acceptance, never
  output. kvrelay's workers key draft pages by that token too, so the two
  never find each other's draft pages (nor a wrong one);
* `draft_indexer`: the draft's indexer keys, in the draft's pages.

SGLang keeps indexer keys quantized (fp8 keys with one fp32 scale per 128 of
them, per page as its device pool lays them out): a layer's indexer block is
that page record, `index_dtype="uint8"` and `index_head_dim` its bytes per
token. kvrelay's runner keeps them in the model dtype, so DSA pages of the two
are different namespaces; MLA pages without an indexer (DeepSeek-V3) agree.

Every other pool (SWA and Mamba states, DeepSeek-V4's compressed pools, draft
SWA) is refused at registration, which fails SGLang's attach: a pool is never
dropped silently.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvrelay.adapters.sglang.identity import PoolGeometry, UnsupportedPool
from kvrelay.layout import ModelKVSpec

KV, INDEXER, DRAFT, DRAFT_INDEXER = "kv", "indexer", "draft", "draft_indexer"
HELD = (KV, INDEXER, DRAFT, DRAFT_INDEXER)


def pool_name(name) -> str:
    """SGLang's PoolName (a str enum) or a plain string, as its value."""
    return str(getattr(name, "value", name))


def refuse_unheld(name: str) -> None:
    if name not in HELD:
        raise UnsupportedPool(
            f"SGLang host pool {name!r} has no kvrelay page form (kvrelay holds "
            f"{', '.join(HELD)}): run this model with another HiCache storage backend"
        )


@dataclass(frozen=True, slots=True)
class IndexerGeometry:
    """A `DSAIndexerPoolHost`: one page record per (page, indexer layer)."""

    layout: str
    page_size: int
    token_bytes: int  # bytes per token of one layer's record (keys and scales)
    host_layers: tuple[int, ...]  # global layer of each host layer (target layers)
    packed_layers: int  # draft tail layers packed after them


def indexer_geometry(pool, anchor_geometry: PoolGeometry) -> IndexerGeometry:
    """Geometry of a registered DSA indexer host pool anchored on `anchor_geometry`."""
    if not hasattr(pool, "index_k_with_scale_buffer") or not hasattr(
        pool, "indexer_page_stride_size"
    ):
        raise UnsupportedPool(
            f"indexer pool {type(pool).__name__} is not a DSA indexer host pool "
            "(QSA and MiniMax indexers have no kvrelay page form)"
        )
    if str(pool.indexer_dtype).removeprefix("torch.") != "uint8":
        raise UnsupportedPool(f"DSA indexer host pool of dtype {pool.indexer_dtype}")
    if pool.page_size != anchor_geometry.page_size or pool.layout != anchor_geometry.layout:
        raise UnsupportedPool("the indexer pool's pages differ from its anchor KV pool's")
    stride = int(pool.indexer_page_stride_size)
    if stride % pool.page_size:
        raise UnsupportedPool(f"indexer page of {stride} bytes over {pool.page_size} tokens")
    start = int(pool.start_layer)
    layers = tuple(start + int(layer) for layer in pool._live_target_layers)
    return IndexerGeometry(
        pool.layout, int(pool.page_size), stride // int(pool.page_size), layers,
        int(pool.layer_num) - int(pool.target_layer_num),
    )  # fmt: skip


def indexed_spec(spec: ModelKVSpec, indexer: IndexerGeometry, config, pp_size: int):
    """The target spec with the indexer's keys after the latent of its layers."""
    if spec.attention_kind != "mla":
        raise UnsupportedPool("an indexer pool beside an MHA KV pool")
    if config.index_topk is None:
        raise UnsupportedPool(
            "a DSA model's pages name its index_topk: set index_topk in the extra config"
        )
    layers = config.index_layers
    if layers is None:
        if pp_size > 1:
            raise UnsupportedPool("with pp_size > 1 the extra config must give index_layers")
        layers = indexer.host_layers
    if not set(indexer.host_layers) <= set(layers):
        raise UnsupportedPool(
            f"the indexer pool holds layers {indexer.host_layers}, not among index_layers {layers}"
        )
    return replace(
        spec,
        index_head_dim=indexer.token_bytes,
        index_dtype="uint8",
        index_layers=tuple(layers),
        index_topk=config.index_topk,
    )


def draft_spec(
    target: ModelKVSpec,
    draft: PoolGeometry,
    config,
    indexer: IndexerGeometry | None,
    tp_size: int,
) -> ModelKVSpec:
    """The draft pages' spec: its geometry from the draft host pool, its
    identity `draft_model_id` (default: the target's, `#draft`)."""
    if draft.start_layer != 0:
        raise UnsupportedPool("a draft pool whose layers do not start at 0")
    heads = 1 if draft.attention_kind == "mla" else config.draft_num_kv_heads
    if heads is None:
        heads = draft.local_heads * tp_size
    index = {}
    if indexer is not None:
        if config.index_topk is None:
            raise UnsupportedPool("a draft indexer's pages name index_topk: set index_topk")
        index = {
            "index_head_dim": indexer.token_bytes,
            "index_dtype": "uint8",
            "index_layers": tuple(range(len(indexer.host_layers))),
            "index_topk": config.index_topk,
        }
    return target.draft_spec(
        model_id=config.draft_model_id or f"{target.model_id}#draft",
        weights_fingerprint=config.draft_weights_fingerprint or target.weights_fingerprint,
        num_layers=draft.local_layers,
        num_kv_heads=heads,
        k_head_dim=draft.k_head_dim,
        v_head_dim=draft.v_head_dim,
        kv_dtype=draft.kv_dtype,
        attention_kind=draft.attention_kind,
        positions="target",  # SGLang's draft slot t sits at position t
        rope_head_dim=draft.rope_head_dim,
        **index,
    )
