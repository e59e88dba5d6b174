"""model/page_copy: the direct path (pool and arena on one device) and the
bounce path (a GPU pool with a host arena) write the same bytes, for every
rank of a TP x PP group sharing one arena. The bounce path is device-generic,
so it runs here on the CPU; on a GPU, tests/model/test_device.py runs it for real."""

import pytest
import torch

from kvrelay.layout import ModelKVSpec, ParallelConfig, rank_rectangle
from kvrelay.model.page_copy import (
    gather_rect,
    gather_through_bounce,
    scatter_rect,
    scatter_through_bounce,
)
from kvrelay.model.pool import PagedKVPool

SPEC = ModelKVSpec(
    model_id="paths",
    weights_fingerprint="",
    num_layers=4,
    num_kv_heads=4,
    k_head_dim=8,
    v_head_dim=8,
    kv_dtype="bfloat16",
    page_size=16,
)
TOKENS = 16 * 3 - 5  # a partial last page


def rank_pool(rect, seed: int) -> PagedKVPool:
    pool = PagedKVPool(num_pages=8, page_size=16, num_layers=rect.num_layers,
                       num_heads=rect.num_heads, head_dim=8, dtype=torch.bfloat16)  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    pool.storage.view(torch.uint8).copy_(
        torch.randint(0, 256, pool.storage.view(torch.uint8).shape, generator=gen)
    )
    return pool


def slot_map() -> torch.Tensor:
    pages = torch.tensor([5, 1, 6])
    positions = torch.arange(48)
    slots = pages[positions // 16] * 16 + positions % 16
    slots[positions >= TOKENS] = -1
    return slots.view(3, 16)


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (2, 2), (8, 1)])
def test_bounce_and_direct_paths_write_the_same_rectangles(tp, pp):
    ranks = [ParallelConfig(tp=tp, pp=pp, tp_rank=r % tp, pp_rank=r // tp) for r in range(tp * pp)]
    rects = [rank_rectangle(SPEC, p) for p in ranks]
    pools = [rank_pool(rect, seed) for seed, rect in enumerate(rects)]
    rows = torch.tensor([4, 0, 2])
    direct = torch.zeros(6, SPEC.page_bytes, dtype=torch.uint8)
    bounced = torch.zeros_like(direct)
    for pool, rect in zip(pools, rects, strict=True):
        if rect.writer:  # one replica of a head writes it (TP > KV heads)
            gather_rect(pool, direct, rows, slot_map(), SPEC, rect)
            gather_through_bounce(pool, bounced, rows, slot_map(), SPEC, rect)
    assert torch.equal(direct, bounced)
    assert direct[[1, 3, 5]].eq(0).all() and direct[rows].ne(0).any()

    for pool, rect in zip(pools, rects, strict=True):
        if not rect.writer:  # a replica reads the writer's bytes, not its own
            continue
        used = slot_map()[slot_map() >= 0]
        want = pool.storage[:, :, used].clone()
        pool.storage.zero_()
        scatter_through_bounce(pool, bounced, rows, slot_map(), SPEC, rect)
        assert torch.equal(pool.storage[:, :, used].view(torch.uint8), want.view(torch.uint8))
        pool.storage.zero_()
        scatter_rect(pool, direct, rows, slot_map(), SPEC, rect)
        assert torch.equal(pool.storage[:, :, used].view(torch.uint8), want.view(torch.uint8))
