"""vLLM CPU cache blocks <-> unified pages, against vLLM's own cache write.

`probe_permutation` learns a block's tiling from `cpu_attn_reshape_and_cache`;
here random K/V written by that op must come out of `BlockPages.gather` as
unified pages position by position, `scatter` must rebuild the op's blocks
bit for bit, and the learned tiling must be the documented one of the vector
kernels (K as [head_dim][block], V as [block][head_dim]) wherever the
machine runs them (AMX runs its own tiling, covered by the same round trips).
"""

from __future__ import annotations

import pytest
import torch

from kvrelay.adapters.vllm.blocks import BlockLayoutError, BlockPages, probe_permutation
from kvrelay.adapters.vllm.worker import cpu_cache_writer

CASES = [  # (block size, head dim, dtype): block sizes not a multiple of 32 run "vec16"
    (128, 32, torch.bfloat16), (128, 64, torch.float32), (32, 128, torch.float16),
    (16, 32, torch.bfloat16), (16, 64, torch.float32),
]  # fmt: skip


def isa(dtype, block_size, head_dim) -> str:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_dim)


def gathered_as_unified(caches, perm, blocks, keys, values) -> torch.Tensor:
    """Gathers the blocks into page rows and checks them unified, position by
    position (page[head][layer] = K[token][dim] ++ V[token][dim]); returns the rows."""
    _, heads, block_size, fused = caches[0].shape
    dtype, layers, head_dim = caches[0].dtype, len(caches), fused // 2
    pages = BlockPages(caches, perm, num_kv_heads=heads, head_start=0)
    rows = torch.zeros(len(blocks), pages.page_bytes, dtype=torch.uint8)
    pages.gather(blocks, rows)
    unified = rows.view(dtype).view(len(blocks), heads, layers, 2, block_size, head_dim)
    for i in range(len(blocks)):
        tokens = slice(i * block_size, (i + 1) * block_size)
        for layer in range(layers):
            assert torch.equal(unified[i, :, layer, 0].transpose(0, 1), keys[layer][tokens])
            assert torch.equal(unified[i, :, layer, 1].transpose(0, 1), values[layer][tokens])
    return rows


@pytest.mark.parametrize(("block_size", "head_dim", "dtype"), CASES)
def test_gather_and_scatter_match_vllms_cache_write(block_size, head_dim, dtype):
    heads, layers, num_blocks = 3, 2, 6
    write = cpu_cache_writer(dtype, block_size, head_dim)
    perm = probe_permutation(write, heads, block_size, head_dim, dtype)
    gen = torch.Generator().manual_seed(block_size + head_dim)
    blocks = [4, 1, 5]  # request pages in another order than the cache's
    slots = torch.cat([torch.arange(b * block_size, (b + 1) * block_size) for b in blocks])
    caches, keys, values = [], [], []
    for _ in range(layers):
        cache = torch.zeros(num_blocks, heads, block_size, 2 * head_dim, dtype=dtype)
        k = torch.randn(len(slots), heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(len(slots), heads, head_dim, generator=gen).to(dtype)
        write(k, v, cache, slots)
        caches.append(cache), keys.append(k), values.append(v)
    rows = gathered_as_unified(caches, perm, blocks, keys, values)
    rebuilt = [torch.zeros_like(c) for c in caches]
    BlockPages(rebuilt, perm, num_kv_heads=heads, head_start=0).scatter(rows, blocks)
    for cache, back in zip(caches, rebuilt, strict=True):
        assert torch.equal(back[blocks], cache[blocks])
        assert not back[[0, 2, 3]].any()  # no other block touched


@pytest.mark.parametrize(("block_size", "head_dim", "dtype"), CASES)
def test_the_vector_kernels_tiling_is_the_documented_one(block_size, head_dim, dtype):
    kind = isa(dtype, block_size, head_dim)
    if kind not in ("vec", "vec16"):
        pytest.skip(f"vLLM runs the {kind} kernel here for this case")
    perm = probe_permutation(
        cpu_cache_writer(dtype, block_size, head_dim), 2, block_size, head_dim, dtype
    )
    token = torch.arange(block_size).view(block_size, 1)
    dim = torch.arange(head_dim).view(1, head_dim)
    k_at = (dim * block_size + token).flatten()  # K[token][dim] sits at [dim][token]
    v_at = (block_size * head_dim + token * head_dim + dim).flatten()
    assert torch.equal(perm, torch.cat([k_at, v_at]))


def test_a_rank_fills_only_its_heads_of_a_page():
    block_size, head_dim, dtype = 16, 32, torch.bfloat16
    write = cpu_cache_writer(dtype, block_size, head_dim)
    perm = probe_permutation(write, 1, block_size, head_dim, dtype)
    cache = torch.randn(2, 1, block_size, 2 * head_dim).to(dtype)
    pages = BlockPages([cache], perm, num_kv_heads=4, head_start=2)
    rows = torch.zeros(1, pages.page_bytes, dtype=torch.uint8)
    pages.gather([1], rows)
    by_head = rows.view(dtype).view(4, -1)
    assert by_head[2].any() and not by_head[[0, 1, 3]].any()


def test_a_writer_that_drops_elements_is_refused():
    def lossy(key, value, cache, slots):
        cache.zero_()  # writes nothing: every element lands at position 0's code

    with pytest.raises(BlockLayoutError, match="exactly once"):
        probe_permutation(lossy, 1, 16, 32, torch.float32)


def test_block_ids_outside_the_cache_are_refused():
    perm = torch.arange(2 * 16 * 32)
    pages = BlockPages([torch.zeros(2, 1, 16, 64)], perm, num_kv_heads=1, head_start=0)
    rows = torch.zeros(1, pages.page_bytes, dtype=torch.uint8)
    with pytest.raises(IndexError):
        pages.gather([2], rows)


def flash_reference_writer(head_dim: int):
    """What vLLM's GPU `reshape_and_cache_flash` does, in torch: the K and V
    views its attention backends take of a [blocks, heads, block, 2*head_dim]
    cache, each token's key and value stored at its slot. (The op itself
    needs CUDA; on a GPU the connector probes the op.)"""

    def write(key, value, cache, slots):
        key_cache, value_cache = cache.transpose(1, 2).split(head_dim, dim=-1)
        block_size = cache.shape[2]
        key_cache[slots // block_size, slots % block_size] = key
        value_cache[slots // block_size, slots % block_size] = value

    return write


def gpu_layout_caches(layout: str, layers, blocks, heads, block_size, fused, dtype):
    """Logical [blocks, heads, block, fused] layer views of one allocation in
    vLLM's GPU layouts: HND (layer-major, that order), NHD (tokens outside
    heads), and block-major NHD (every layer of a block together)."""
    if layout == "HND":
        buf = torch.zeros(layers, blocks, heads, block_size, fused, dtype=dtype)
        return [buf[i] for i in range(layers)]
    if layout == "NHD":
        buf = torch.zeros(layers, blocks, block_size, heads, fused, dtype=dtype)
        return [buf[i].transpose(1, 2) for i in range(layers)]
    buf = torch.zeros(blocks, layers, block_size, heads, fused, dtype=dtype)
    return [buf[:, i].transpose(1, 2) for i in range(layers)]


@pytest.mark.parametrize("layout", ["HND", "NHD", "block-major NHD"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_layouts_move_pages_position_by_position(layout, dtype):
    from kvrelay.adapters.vllm.handoff import layout_fingerprint

    layers, num_blocks, heads, block_size, head_dim = 2, 5, 3, 16, 8
    write = flash_reference_writer(head_dim)
    perm = probe_permutation(write, heads, block_size, head_dim, dtype)
    token = torch.arange(block_size).view(block_size, 1)
    dim = torch.arange(head_dim).view(1, head_dim)
    k_at = (token * 2 * head_dim + dim).flatten()  # plain content: K[dim] ++ V[dim] per token
    assert torch.equal(perm, torch.cat([k_at, k_at + head_dim]))
    caches = gpu_layout_caches(layout, layers, num_blocks, heads, block_size, 2 * head_dim, dtype)
    blocks = [3, 0]
    slots = torch.cat([torch.arange(b * block_size, (b + 1) * block_size) for b in blocks])
    gen = torch.Generator().manual_seed(5)
    keys = [torch.randn(len(slots), heads, head_dim, generator=gen).to(dtype) for _ in caches]
    values = [torch.randn(len(slots), heads, head_dim, generator=gen).to(dtype) for _ in caches]
    for cache, k, v in zip(caches, keys, values, strict=True):
        write(k, v, cache, slots)
    rows = gathered_as_unified(caches, perm, blocks, keys, values)
    rebuilt = gpu_layout_caches(layout, layers, num_blocks, heads, block_size, 2 * head_dim, dtype)
    BlockPages(rebuilt, perm, num_kv_heads=heads, head_start=0).scatter(rows, blocks)
    for cache, back in zip(caches, rebuilt, strict=True):
        assert torch.equal(back, cache)  # the blocks rebuilt, no other touched
    # Blocks move raw between engines only between equal axis orders.
    hnd = gpu_layout_caches("HND", 1, 2, heads, block_size, 2 * head_dim, dtype)[0]
    same = layout_fingerprint(perm, caches[0]) == layout_fingerprint(perm, hnd)
    assert same == (layout == "HND")
