"""The small model KV spec the cache tests share: 4 heads x 4 layers, 4-token pages."""

from kvrelay.layout import ModelKVSpec

SPEC = ModelKVSpec(
    model_id="m",
    weights_fingerprint="w",
    num_layers=4,
    num_kv_heads=4,
    k_head_dim=8,
    v_head_dim=8,
    kv_dtype="float16",
    page_size=4,
)
