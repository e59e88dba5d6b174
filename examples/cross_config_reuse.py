"""Export a prefix's KV under TP=2 x PP=2 and import it under TP=1, on one machine.

Four "ranks" each hold their rectangle (heads x layers) of a model's KV in
their own paged pool. Each writes its rectangle of the request's unified pages
(gather_pages); a TP=1 rank with a differently fragmented pool then reads
whole pages back (scatter_pages) and ends up with the same K and V, token by
token. The transfer engine and cache tier move exactly these page objects.

    python examples/cross_config_reuse.py
"""

import torch

from kvrelay.cuda_ext import (
    BACKEND_NAME,
    gather_pages,
    rect_geometry,
    scatter_pages,
    slot_mapping_from_block_table,
)
from kvrelay.layout import ModelKVSpec, ParallelConfig, rank_rectangle

spec = ModelKVSpec(
    model_id="example-llama",
    weights_fingerprint="demo",
    num_layers=4,
    num_kv_heads=4,
    k_head_dim=16,
    v_head_dim=16,
    kv_dtype="bfloat16",
    page_size=16,
)
tokens = list(range(1000, 1000 + 5 * spec.page_size))
keys = spec.page_keys(tokens)
gen = torch.Generator().manual_seed(0)

# The reference KV of every token, layer and head (what the model would compute).
k_all = torch.randn(spec.num_layers, len(tokens), 4, 16, generator=gen).to(torch.bfloat16)
v_all = torch.randn(spec.num_layers, len(tokens), 4, 16, generator=gen).to(torch.bfloat16)


def engine_pool(rect, engine_page, seed):
    """A rank's pool: its heads and layers, tokens on shuffled engine pages."""
    g = torch.Generator().manual_seed(seed)
    engine_pages = len(tokens) // engine_page + 2
    table = torch.randperm(engine_pages, generator=g)
    slots = slot_mapping_from_block_table(table, engine_page, len(tokens), spec.page_size)
    shape = (engine_pages * engine_page, rect.num_heads, 16)
    k = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(rect.num_layers)]
    v = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(rect.num_layers)]
    return k, v, slots


pages = torch.zeros(len(keys), spec.page_bytes, dtype=torch.uint8)
page_ids = torch.arange(len(keys))

writer = ParallelConfig(tp=2, pp=2)
for rank in writer.all_ranks():
    rect = rank_rectangle(spec, rank)
    k, v, slots = engine_pool(rect, engine_page=8, seed=rank.rank)
    heads, layers = slice(rect.head_start, rect.head_end), range(rect.layer_start, rect.layer_end)
    flat = slots.flatten()[: len(tokens)]
    for i, layer in enumerate(layers):  # the "prefill" fills this rank's pool
        k[i][flat] = k_all[layer][:, heads]
        v[i][flat] = v_all[layer][:, heads]
    gather_pages(k, v, pages, page_ids, slots, **rect_geometry(spec, rect))
    print(
        f"writer {rank.tp_rank=} {rank.pp_rank=}: heads {heads.start}-{heads.stop - 1}, "
        f"layers {rect.layer_start}-{rect.layer_end - 1}, runs {rect.byte_runs(spec)[:2]}..."
    )

reader = rank_rectangle(spec, ParallelConfig())
k, v, slots = engine_pool(reader, engine_page=16, seed=99)
scatter_pages(k, v, pages, page_ids, slots, **rect_geometry(spec, reader))
flat = slots.flatten()[: len(tokens)]
same = all(
    torch.equal(k[layer][flat], k_all[layer]) and torch.equal(v[layer][flat], v_all[layer])
    for layer in range(spec.num_layers)
)
print(
    f"{len(keys)} pages of {spec.page_bytes} bytes, first key {keys[0].hex()[:16]}..., "
    f"backend {BACKEND_NAME}"
)
print("TP=1 reader recovered every K and V:", same)
raise SystemExit(0 if same else 1)
