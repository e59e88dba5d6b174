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
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.mem_cache.utils import get_hash_str

    import kvrelay.adapters.sglang.storage  # noqa: F401  (imports SGLang's observability)

__all__ = ["HiCacheFile", "HiCacheStorageConfig"]

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


def mla_pool(layout, *, layers, start_layer, page_size, width, dtype):
    """A real MLATokenToKVPoolHost on CPU (latent rows of `width`, rope included)."""
    rows = tuple(torch.zeros(DEVICE_TOKENS, 1, width, dtype=dtype) for _ in range(layers))
    info = MLABufferInfo(
        buffers=rows, data_ptrs=_ptrs(rows), layer_indices=tuple(range(layers)),
        device_layer_num=layers, page_size=page_size, kv_lora_rank=width - 4,
        qk_rope_head_dim=4, kv_cache_dim=width, dtype=dtype, device=torch.device("cpu"),
    )  # fmt: skip
    return MLATokenToKVPoolHost(
        info, 2.0, 0, page_size, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=DEVICE_TOKENS, start_layer=start_layer,
        end_layer=start_layer + layers, target_layer_num=layers,
    )  # fmt: skip


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


def sglang_keys(tokens, page_size) -> list[str]:
    return get_hash_str(tokens, None, page_size=page_size)


class CacheServerProcess(launch.CacheServerProcess):
    """`kvrelay launch cache` in a process of its own, for pages of `page_bytes`."""

    def __init__(self, page_bytes: int, pages: int = 64) -> None:
        super().__init__(token=TOKEN, page_bytes=page_bytes, pages=pages)
