"""SGLang HiCache L3 storage backend on kvrelay's cache tier.

SGLang loads it through its `dynamic` storage backend:

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name": "kvrelay", "module_path": "kvrelay.adapters.sglang.storage",
      "class_name": "KvrelayHiCacheStorage", "interface_v1": 1, "servers": [...], ...}'

`config` parses the extra config, `identity` maps SGLang's model, rank and page
keys onto kvrelay's unified layout, `pool_io` moves a rank's rectangle between
SGLang's host pool and unified pages, and `storage` is the `HiCacheStorage`
subclass (with `harness`, the real host pools and cache server processes that
the tests and `kvrelay bench sglang` drive it with, the only modules that import
SGLang).
"""
