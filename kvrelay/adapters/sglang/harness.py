"""Real SGLang pieces on a CPU-only torch, for the adapter tests and `kvrelay bench sglang`.

Host pools built as SGLang's cache controller builds them, the backend created
through SGLang's `StorageBackendFactory`, and `kvrelay launch cache` servers in
processes of their own. Importing this module imports SGLang (ImportError when
it is not installed: `make sglang-deps`).

SGLang's storage and host-pool modules import `sglang.srt.configs`, which
imports torchvision for multimodal preprocessing: the CPU layer's
`torchvision_op_schemas` (`kvrelay.adapters.sglang.cpu.patches`) lets the
index's CUDA build of it import beside CPU torch.
"""

from __future__ import annotations

import warnings
from array import array
from types import SimpleNamespace

import torch

from kvrelay.adapters.sglang.cpu.patches import torchvision_op_schemas
from kvrelay.cache import launch

# SGLang's import warns about CUDA-only quantizers and deprecated torch APIs;
# the test suite turns warnings into errors, so they are silenced for the import only.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torchvision_op_schemas()
    from sglang.srt.mem_cache.device_pool_info import (
        KVBufferLayout,
        KVBuffers,
        MHABufferInfo,
        MLABufferInfo,
    )
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheFile,
        HiCacheStorageConfig,
        PoolHitPolicy,
        PoolName,
        PoolTransfer,
    )
    from sglang.srt.mem_cache.pool_host.dsa import (
        DSAIndexerPoolHost,
        make_dsa_indexer_pool_decl,
    )
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.mem_cache.utils import get_hash_str

    import kvrelay.adapters.sglang.storage  # noqa: F401  (imports SGLang's observability)

__all__ = ["HiCacheFile", "HiCacheStorageConfig", "PoolHitPolicy", "PoolName", "PoolTransfer"]

TOKEN = "sglang-adapter-test"
DEVICE_TOKENS = 64  # device pool size the host pool is sized against


def _ptrs(tensors) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def mha_pool(layout, *, heads, layers, start_layer, page_size, head_dim, dtype, groups=1,
             device_tokens=DEVICE_TOKENS):  # fmt: skip
    """A real MHATokenToKVPoolHost on CPU for one rank (its heads and layers),
    of twice `device_tokens` tokens."""
    k = tuple(torch.zeros(device_tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(device_tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=_ptrs(k), v_data_ptrs=_ptrs(v),
                          layout=KVBufferLayout.NHD),
        page_size=page_size, head_num=heads, head_dim=head_dim, v_head_dim=head_dim,
        dtype=dtype, device=torch.device("cpu"),
    )  # fmt: skip
    return MHATokenToKVPoolHost(
        info, 2.0, 0, page_size, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=device_tokens, start_layer=start_layer,
        end_layer=start_layer + layers, head_group_num=groups,
    )  # fmt: skip


def _mla_info(layers, page_size, width, dtype, rope, device_tokens):
    rows = tuple(torch.zeros(device_tokens, 1, width, dtype=dtype) for _ in range(layers))
    return MLABufferInfo(
        buffers=rows, data_ptrs=_ptrs(rows), layer_indices=tuple(range(layers)),
        device_layer_num=layers, page_size=page_size, kv_lora_rank=width - rope,
        qk_rope_head_dim=rope, kv_cache_dim=width, dtype=dtype, device=torch.device("cpu"),
    )  # fmt: skip


def mla_pool(layout, *, layers, start_layer, page_size, width, dtype, rope=4, packed=0,
             device_tokens=DEVICE_TOKENS):  # fmt: skip
    """A real MLATokenToKVPoolHost on CPU (latent rows of `width`, the last
    `rope` of them the RoPE part), `packed` draft layers after the target's."""
    info = _mla_info(layers, page_size, width, dtype, rope, device_tokens)
    drafts = [_mla_info(1, page_size, width, dtype, rope, device_tokens) for _ in range(packed)]
    return MLATokenToKVPoolHost(
        info, 2.0, 0, page_size, layout, pin_memory=False, device="cpu",
        draft_buffer_infos=drafts, device_capacity_tokens=device_tokens,
        start_layer=start_layer, end_layer=start_layer + layers, target_layer_num=layers,
    )  # fmt: skip


INDEX_HEAD_DIM = 128  # SGLang's DSA pools hold 128-wide keys (fp8) and one fp32 scale


def dsa_indexer_pool(anchor, *, skip=(), packed=0, device_tokens=DEVICE_TOKENS):
    """SGLang's DSAIndexerPoolHost on `anchor` (an MLA host pool), built from
    the declaration SGLang's DSA device pool makes (`make_dsa_indexer_pool_decl`);
    layers in `skip` (local) reuse another layer's top-k and hold no keys.
    The device pool is a stand-in holding what the host pool reads of it."""
    layers, ps = anchor.target_layer_num, anchor.page_size
    record = ps * (INDEX_HEAD_DIM + 4)

    def device_pool(count, skips):
        return SimpleNamespace(
            index_head_dim=INDEX_HEAD_DIM, quant_block_size=128, index_page_size=ps,
            page_size=ps, skip_topk_layers=[i in skips for i in range(count)],
            store_dtype=torch.uint8, start_layer=anchor.start_layer,
            end_layer=anchor.start_layer + count, layer_num=count, layer_shard_enabled=False,
            device="cpu", index_k_with_scale_buffer=[
                torch.zeros((0 if i in skips else device_tokens // ps + 1, record),
                            dtype=torch.uint8) for i in range(count)],
        )  # fmt: skip

    target = device_pool(layers, set(skip))
    decl = make_dsa_indexer_pool_decl(target, name=PoolName.INDEXER)
    drafts = tuple(device_pool(1, set()) for _ in range(packed))
    return DSAIndexerPoolHost(decl=decl, anchor_host=anchor, packed_draft_device_pools=drafts,
                              pin_memory=False, device="cpu")  # fmt: skip


def storage_config(*, tp=1, tp_rank=0, pp=1, pp_rank=0, mla=False, layout="", extra=None,
                   model_name="test/tiny-model"):  # fmt: skip
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp, pp_rank=pp_rank, pp_size=pp, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
        is_page_first_layout=layout == "page_first", model_name=model_name,
        extra_config=dict(extra or {}),
    )  # fmt: skip


def dynamic_extra(servers, **identity) -> dict:
    """The extra config of the README's launch line, for these servers."""
    return {
        "backend_name": "kvrelay",
        "module_path": "kvrelay.adapters.sglang.storage",
        "class_name": "KvrelayHiCacheStorage",
        "interface_v1": 1,
        "servers": [s.address for s in servers],
        "token": TOKEN,
        "backend": "tcp",
        "timeout_s": 3.0,
        "staging_pages": 3,  # smaller than a call, so calls span several chunks
        **identity,
    }


def create_backend(config, pool):
    """As SGLang's cache controller does: the factory, then the host pool."""
    backend = StorageBackendFactory.create_backend("dynamic", config, None)
    backend.register_mem_pool_host(pool)
    return backend


def sglang_keys(tokens, page_size, *, eagle: bool = False) -> list[str]:
    """SGLang's page keys of `tokens`. With EAGLE / MTP its radix tree keys a
    prompt by token pairs (t_i, t_i+1), so a page needs the next page's first
    token."""
    if eagle:
        return get_hash_str(RadixKey(array("q", tokens), is_bigram=True), None, page_size)
    return get_hash_str(tokens, None, page_size=page_size)


class CacheServerProcess(launch.CacheServerProcess):
    """`kvrelay launch cache` in a process of its own, for pages of `page_bytes`."""

    def __init__(self, page_bytes: int, pages: int = 64) -> None:
        super().__init__(token=TOKEN, page_bytes=page_bytes, pages=pages)
