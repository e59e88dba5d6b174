"""Latent pools to unified pages and back, position by position, across
pipeline splits: the bytes of a page do not depend on who wrote it."""

import pytest
import torch

from kvrelay.layout import LayoutError, ModelKVSpec, ParallelConfig, rank_rectangle
from kvrelay.model.latent_pool import LatentKVPool
from kvrelay.model.page_copy import gather_rect, scatter_rect

PS = 8
LAYERS = 4
INDEXED = (0, 1, 3)


def spec() -> ModelKVSpec:
    return ModelKVSpec(
        model_id="glm_moe_dsa:t",
        weights_fingerprint="",
        num_layers=LAYERS,
        num_kv_heads=1,
        k_head_dim=12,
        v_head_dim=0,
        kv_dtype="bfloat16",
        attention_kind="mla",
        page_size=PS,
        rope_head_dim=4,
        index_head_dim=6,
        index_dtype="float32",
        index_layers=INDEXED,
        index_topk=16,
    )


def pool_for(rect, num_pages=6) -> LatentKVPool:
    local = tuple(layer - rect.layer_start for layer in INDEXED if rect.layer_start <= layer
                  < rect.layer_end)  # fmt: skip
    return LatentKVPool(
        num_pages=num_pages,
        page_size=PS,
        num_layers=rect.num_layers,
        latent_dim=12,
        index_dim=6,
        index_local_layers=local,
        dtype=torch.bfloat16,
        index_dtype=torch.float32,
    )


def fill(pool: LatentKVPool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    pool.latent_storage.copy_(torch.randn(pool.latent_storage.shape, generator=gen))
    pool.index_storage.copy_(torch.randn(pool.index_storage.shape, generator=gen))


def test_gather_lays_out_each_layer_latent_then_indexer_keys():
    s = spec()
    rect = rank_rectangle(s, ParallelConfig())
    pool = pool_for(rect)
    fill(pool, 0)
    slots = torch.tensor([[3 * PS + t for t in range(PS)], [1 * PS + t for t in range(PS)]])
    slots[1, 5:] = -1  # a partial last page: zeros past its last token
    arena = torch.full((4, s.page_bytes), 0xAB, dtype=torch.uint8)
    gather_rect(pool, arena, torch.tensor([2, 0]), slots, s, rect)
    for row, page_slots in ((2, slots[0]), (0, slots[1])):
        for layer in range(LAYERS):
            off = s.layer_offset(layer)
            latent = arena[row, off : off + PS * 24].view(torch.bfloat16).view(PS, 12)
            for token in range(PS):
                slot = int(page_slots[token])
                want = pool.latent_layers[layer][slot] if slot >= 0 else torch.zeros(12)
                assert torch.equal(latent[token], want.to(torch.bfloat16))
            if layer in INDEXED:
                keys = arena[row, off + PS * 24 : off + PS * 48].view(torch.float32).view(PS, 6)
                for token in range(PS):
                    slot = int(page_slots[token])
                    want = pool.index_keys[layer][slot] if slot >= 0 else torch.zeros(6)
                    assert torch.equal(keys[token], want)
    assert (arena[1] == 0xAB).all() and (arena[3] == 0xAB).all()


def test_pages_written_by_two_stages_read_by_one_and_back():
    s = spec()
    split = ParallelConfig(pp=2, tp=2)
    arena = torch.zeros((3, s.page_bytes), dtype=torch.uint8)
    slots = torch.arange(3 * PS).view(3, PS)
    rows = torch.arange(3)
    pools = {}
    for rank in split.all_ranks():
        rect = rank_rectangle(s, rank)
        pools[rank] = pool_for(rect)
        fill(pools[rank], rank.pp_rank)  # TP replicas hold the same latents
        if rect.writer:
            gather_rect(pools[rank], arena, rows, slots, s, rect)
    whole_rect = rank_rectangle(s, ParallelConfig())
    whole = pool_for(whole_rect)
    scatter_rect(whole, arena, rows, slots, s, whole_rect)
    stage0 = pools[split.with_rank(0, 0)]
    stage1 = pools[split.with_rank(0, 1)]
    n = 3 * PS
    assert torch.equal(whole.latent_storage[:2, :n], stage0.latent_storage[:, :n])
    assert torch.equal(whole.latent_storage[2:, :n], stage1.latent_storage[:, :n])
    assert torch.equal(whole.index_keys[0][:n], stage0.index_keys[0][:n])
    assert torch.equal(whole.index_keys[3][:n], stage1.index_keys[1][:n])
    # And back: the single-stage pool's pages are the same bytes.
    again = torch.zeros_like(arena)
    gather_rect(whole, again, rows, slots, s, whole_rect)
    assert torch.equal(again, arena)


def test_scatter_skips_missing_slots():
    s = spec()
    rect = rank_rectangle(s, ParallelConfig())
    source, target = pool_for(rect), pool_for(rect)
    fill(source, 1)
    fill(target, 2)
    before = target.latent_storage.clone()
    arena = torch.zeros((1, s.page_bytes), dtype=torch.uint8)
    slots = torch.arange(PS)[None]
    gather_rect(source, arena, torch.tensor([0]), slots, s, rect)
    slots = slots.clone()
    slots[0, 3:] = -1
    scatter_rect(target, arena, torch.tensor([0]), slots, s, rect)
    assert torch.equal(target.latent_storage[:, :3], source.latent_storage[:, :3])
    assert torch.equal(target.latent_storage[:, 3:], before[:, 3:])


def test_a_pool_of_another_shape_is_refused():
    s = spec()
    rect = rank_rectangle(s, ParallelConfig())
    wrong = LatentKVPool(num_pages=2, page_size=PS, num_layers=LAYERS, latent_dim=12,
                         index_dim=6, index_local_layers=(0, 1), dtype=torch.bfloat16)  # fmt: skip
    arena = torch.zeros((1, s.page_bytes), dtype=torch.uint8)
    with pytest.raises(LayoutError, match="indexer layers"):
        gather_rect(wrong, arena, torch.tensor([0]), torch.arange(PS)[None], s, rect)
