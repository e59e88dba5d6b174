"""The paged KV pool: free list, reference counts, prefix index, eviction."""

import pytest
import torch

from kvrelay.model import PagedKVPool, PoolExhausted


def make_pool(num_pages=4, page_size=4):
    return PagedKVPool(
        num_pages=num_pages,
        page_size=page_size,
        num_layers=2,
        num_heads=2,
        head_dim=8,
        dtype=torch.float32,
    )


def key(i: int) -> bytes:
    return bytes([i]) * 32


def test_allocation_is_all_or_nothing():
    pool = make_pool()
    taken = pool.allocate(3)
    assert len(set(taken)) == 3 and pool.free_pages == 1
    with pytest.raises(PoolExhausted) as caught:
        pool.allocate(2)
    assert (caught.value.needed, caught.value.available) == (2, 1)
    assert pool.free_pages == 1
    pool.release(taken)
    assert pool.free_pages == 4


def test_shared_pages_are_counted_and_cached_after_release():
    pool = make_pool()
    a, b = pool.allocate(2)
    assert pool.register(a, key(1)) and pool.register(b, key(2))
    assert pool.match_prefix([key(1), key(2), key(3)]) == [a, b]
    assert pool.ref_counts[a] == 2
    pool.release([a, b])
    pool.release([a, b])
    # Unused but cached: still found, and still allocatable.
    assert pool.ref_counts[a] == 0 and pool.cached_pages == 2
    assert pool.free_pages == 4
    assert pool.match_prefix([key(1)]) == [a]
    pool.release([a])


def test_match_stops_at_the_first_missing_key():
    pool = make_pool()
    a, b = pool.allocate(2)
    pool.register(a, key(1))
    pool.register(b, key(3))
    assert pool.match_prefix([key(1), key(2), key(3)]) == [a]


def test_eviction_takes_the_least_recently_released_cached_page():
    pool = make_pool(num_pages=3)
    pages = pool.allocate(3)
    for i, page in enumerate(pages):
        pool.register(page, key(i))
    pool.release([pages[1]])
    pool.release([pages[0]])
    pool.release([pages[2]])
    (taken,) = pool.allocate(1)
    assert taken == pages[1]
    assert pool.match_prefix([key(1)]) == []
    assert pool.cached_pages == 2


def test_a_page_in_use_is_never_evicted():
    pool = make_pool(num_pages=2)
    a, b = pool.allocate(2)
    pool.register(a, key(1))
    pool.release([b])
    assert pool.allocate(1) == [b]
    with pytest.raises(PoolExhausted):
        pool.allocate(1)


def test_a_key_is_indexed_once():
    pool = make_pool()
    a, b = pool.allocate(2)
    assert pool.register(a, key(1))
    assert not pool.register(b, key(1))
    pool.release([a, b])
    assert pool.cached_pages == 1 and pool.key_of(b) is None


def test_double_release_is_an_error():
    pool = make_pool()
    (a,) = pool.allocate(1)
    pool.release([a])
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([a])


def test_slots_follow_the_page_table():
    pool = make_pool(page_size=4)
    assert pool.slots([2, 0], 6).tolist() == [8, 9, 10, 11, 0, 1]


def test_pool_tensors_share_one_layout_for_the_page_ops():
    pool = make_pool()
    strides = {t.stride() for t in pool.k_layers + pool.v_layers}
    assert len(strides) == 1
    assert pool.k_layers[0].shape == (16, 2, 8)


def test_partial_page_keys_never_collide_with_the_chain():
    from kvrelay.layout import page_keys
    from kvrelay.model.pool import partial_page_key

    parent = key(7)
    tokens = [1, 2, 3, 4]
    assert partial_page_key(parent, tokens) != page_keys(parent, tokens, 4)[0]
    assert partial_page_key(parent, tokens[:3]) != partial_page_key(parent, tokens)
    assert partial_page_key(parent, tokens) != partial_page_key(key(8), tokens)


def test_copy_tokens_copies_k_and_v_of_every_layer_and_only_count_tokens():
    pool = make_pool(page_size=4)
    a, b = pool.allocate(2)
    pool.storage.normal_()
    before = pool.storage.clone()
    pool.copy_tokens(a, b, 3)
    src, dst = slice(a * 4, a * 4 + 3), slice(b * 4, b * 4 + 3)
    assert torch.equal(pool.storage[:, :, dst], before[:, :, src])
    assert torch.equal(pool.storage[:, :, b * 4 + 3], before[:, :, b * 4 + 3])
    assert torch.equal(pool.storage[:, :, a * 4 : a * 4 + 4], before[:, :, a * 4 : a * 4 + 4])
