"""Real SGLang on a CPU-only torch, real host pools, real cache server processes:
the shared pieces live in `kvrelay.adapters.sglang.harness` (the bench uses them too)."""

from kvrelay.adapters.sglang.harness import (  # noqa: F401
    DEVICE_TOKENS,
    TOKEN,
    CacheServerProcess,
    create_backend,
    dynamic_extra,
    mha_pool,
    mla_pool,
    sglang_keys,
    storage_config,
)
