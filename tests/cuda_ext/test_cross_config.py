"""The ops against the layout itself: byte positions, rectangles, cross-config reuse.

Logits cannot see a consistent permutation of K and V, so the page bytes are
checked position by position against ModelKVSpec.block_offset, and a prefix
written by one parallel config is read back under others.
"""

import pytest
import torch

from kvrelay.cuda_ext import gather_pages, rect_geometry, scatter_pages
from kvrelay.layout import ModelKVSpec, ParallelConfig, rank_rectangle

SPEC = ModelKVSpec(
    model_id="m",
    weights_fingerprint="w",
    num_layers=4,
    num_kv_heads=4,
    k_head_dim=6,
    v_head_dim=3,
    kv_dtype="bfloat16",
    page_size=8,
)
NUM_TOKENS = 3 * SPEC.page_size  # full pages only: what the cache tier keys


def full_pool(seed: int):
    """A TP=1 PP=1 engine's pool: token i at slot perm[i]; all heads and layers."""
    gen = torch.Generator().manual_seed(seed)
    num_slots = NUM_TOKENS + 16
    k = [
        torch.randn(num_slots, SPEC.num_kv_heads, SPEC.k_head_dim, generator=gen).to(torch.bfloat16)
        for _ in range(SPEC.num_layers)
    ]
    v = [
        torch.randn(num_slots, SPEC.num_kv_heads, SPEC.v_head_dim, generator=gen).to(torch.bfloat16)
        for _ in range(SPEC.num_layers)
    ]
    slots = torch.randperm(num_slots, generator=gen)[:NUM_TOKENS].view(-1, SPEC.page_size)
    return k, v, slots.contiguous()


def shard(tensors, rect):
    """What a rank of rectangle `rect` holds in its own pool: its heads, its layers."""
    return [
        t[:, rect.head_start : rect.head_end].contiguous()
        for t in tensors[rect.layer_start : rect.layer_end]
    ]


def test_page_bytes_follow_the_layout_position_by_position():
    k, v, slots = full_pool(0)
    pages = torch.zeros(slots.size(0), SPEC.page_bytes, dtype=torch.uint8)
    ids = torch.arange(slots.size(0))
    gather_pages(k, v, pages, ids, slots, page_heads=4, page_layers=4)
    k_row, v_row = SPEC.k_row_bytes, SPEC.v_row_bytes
    for p in range(slots.size(0)):
        for head in range(SPEC.num_kv_heads):
            for layer in range(SPEC.num_layers):
                block = SPEC.block_offset(head, layer)
                for t in range(SPEC.page_size):
                    slot = slots[p, t]
                    k_at = block + t * k_row
                    v_at = block + SPEC.page_size * k_row + t * v_row
                    assert torch.equal(
                        pages[p, k_at : k_at + k_row], k[layer][slot, head].view(torch.uint8)
                    )
                    assert torch.equal(
                        pages[p, v_at : v_at + v_row], v[layer][slot, head].view(torch.uint8)
                    )


@pytest.mark.parametrize(
    "config",
    [ParallelConfig(tp=2, pp=2), ParallelConfig(tp=4), ParallelConfig(pp=3), ParallelConfig(tp=8)],
)
def test_a_rank_writes_exactly_its_byte_runs(config):
    k, v, slots = full_pool(1)
    ids = torch.arange(slots.size(0))
    sentinel = 0xA5
    for rank in config.all_ranks():
        rect = rank_rectangle(SPEC, rank)
        pages = torch.full((slots.size(0), SPEC.page_bytes), sentinel, dtype=torch.uint8)
        gather_pages(shard(k, rect), shard(v, rect), pages, ids, slots, **rect_geometry(SPEC, rect))
        inside = torch.zeros(SPEC.page_bytes, dtype=torch.bool)
        for offset, length in rect.byte_runs(SPEC):
            inside[offset : offset + length] = True
        assert pages[:, ~inside].eq(sentinel).all()
        assert not pages[:, inside].eq(sentinel).all()


WRITERS = [
    ParallelConfig(tp=2, pp=2),
    ParallelConfig(),
    ParallelConfig(tp=4),
    ParallelConfig(pp=4),
    ParallelConfig(tp=8, pp=2),
]
READERS = [
    ParallelConfig(),
    ParallelConfig(tp=2, pp=2),
    ParallelConfig(tp=8),
    ParallelConfig(pp=2, tp=4),
    ParallelConfig(pp=3, pp_layer_split=(1, 2, 1)),
]


@pytest.mark.parametrize("writer", WRITERS, ids=str)
@pytest.mark.parametrize("reader", READERS, ids=str)
def test_prefix_written_under_one_config_is_read_under_another(writer, reader):
    k, v, slots = full_pool(2)
    num_pages = slots.size(0)
    # The unified pages sit in an arena at arbitrary rows, as in a cache tier.
    arena = torch.zeros(num_pages + 3, SPEC.page_bytes, dtype=torch.uint8)
    ids = torch.tensor([4, 0, 2])
    for rank in writer.all_ranks():
        rect = rank_rectangle(SPEC, rank)
        if rect.writer:
            gather_pages(
                shard(k, rect), shard(v, rect), arena, ids, slots, **rect_geometry(SPEC, rect)
            )
    for rank in reader.all_ranks():
        rect = rank_rectangle(SPEC, rank)
        # The reader's own pool: fresh, with the tokens at other slots.
        gen = torch.Generator().manual_seed(rank.rank)
        read_slots = torch.randperm(NUM_TOKENS + 5, generator=gen)[:NUM_TOKENS]
        read_slots = read_slots.view(num_pages, -1).contiguous()
        k_mine = [
            torch.zeros(NUM_TOKENS + 5, rect.num_heads, SPEC.k_head_dim, dtype=torch.bfloat16)
            for _ in range(rect.num_layers)
        ]
        v_mine = [
            torch.zeros(NUM_TOKENS + 5, rect.num_heads, SPEC.v_head_dim, dtype=torch.bfloat16)
            for _ in range(rect.num_layers)
        ]
        scatter_pages(k_mine, v_mine, arena, ids, read_slots, **rect_geometry(SPEC, rect))
        flat_w, flat_r = slots.flatten(), read_slots.flatten()
        for want, got in zip(shard(k, rect) + shard(v, rect), k_mine + v_mine, strict=True):
            assert torch.equal(got[flat_r].view(torch.uint8), want[flat_w].view(torch.uint8))


def test_compact_rectangle_buffer_round_trips():
    """A rank may stage only its share: a page object of its own heads x layers."""
    k, v, slots = full_pool(3)
    rect = rank_rectangle(SPEC, ParallelConfig(tp=2, pp=2, tp_rank=1, pp_rank=0))
    geometry = rect_geometry(SPEC, rect, compact=True)
    staged = torch.zeros(slots.size(0), rect.num_bytes(SPEC), dtype=torch.uint8)
    ids = torch.arange(slots.size(0))
    gather_pages(shard(k, rect), shard(v, rect), staged, ids, slots, **geometry)
    full = torch.zeros(slots.size(0), SPEC.page_bytes, dtype=torch.uint8)
    gather_pages(k, v, full, ids, slots, page_heads=4, page_layers=4)
    # The compact buffer is the full page's runs, concatenated in order.
    runs = torch.cat([full[:, o : o + n] for o, n in rect.byte_runs(SPEC)], dim=1)
    assert torch.equal(staged, runs)
