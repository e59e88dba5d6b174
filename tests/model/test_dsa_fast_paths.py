"""The DSA indexer's tiled scores and flat-row top-k, and sparse attention's
cache-sized gathers, equal the paths they replace (tests.model.dsa_reference)
bit for bit: the same tokens in the same order, the same attention output.
Small blocks, tiles and gathers make every loop run several times with a
remainder; keys on a coarse grid make exact ties, negative indexer weights
make rows flat at zero."""

import pytest
import torch

from kvrelay.model import dsa_indexer, mla_attention
from kvrelay.model.attention import AttentionBatch
from kvrelay.model.dsa_topk import top_k
from tests.model import dsa_reference

PAGE = 16


def paged(rows: torch.Tensor, gen, extra_pages: int = 3):
    """(pool layer holding `rows` on shuffled pages, page table)."""
    pages = -(-rows.size(0) // PAGE)
    table = torch.randperm(pages + extra_pages, generator=gen)[:pages]
    layer = torch.zeros((pages + extra_pages) * PAGE, rows.size(1), dtype=rows.dtype)
    for i, page in enumerate(table.tolist()):
        chunk = rows[i * PAGE : (i + 1) * PAGE]
        layer[page * PAGE : page * PAGE + chunk.size(0)] = chunk
    return layer, table


def batch_of(sequences, tables) -> AttentionBatch:
    """sequences: (new tokens, context) each, rows in this order."""
    starts, start = [], 0
    for length, _ in sequences:
        starts.append(start)
        start += length
    lengths, contexts = zip(*sequences, strict=True)
    return AttentionBatch(tuple(starts), lengths, contexts, tuple(tables), PAGE)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("heads", [2, 4])
def test_selection_equals_the_reference(monkeypatch, dtype, heads):
    monkeypatch.setattr(dsa_indexer, "SCORE_BLOCK_ELEMENTS", 1 << 14)
    monkeypatch.setattr(dsa_indexer, "SCORE_TILE_ELEMENTS", 1 << 10)
    monkeypatch.setattr(dsa_indexer, "SCORE_GROUP_WIDTH", 6)
    gen = torch.Generator().manual_seed(heads)
    topk, dim = 48, 16
    # A chunk after a cached prefix, a whole prefill, a decode row: rows
    # from shorter than index_topk to 25x it (the flat rows' prefix is 8x).
    sequences = [(300, 1200), (500, 500), (1, 900)]
    layers, tables = [], []
    for _, context in sequences:
        keys = (torch.randn(context, dim, generator=gen, dtype=torch.float64) * 4).round() / 4
        layer, table = paged(keys.to(dtype), gen)
        layers.append(layer)
        tables.append(table)
    # One pool layer: each sequence's pages offset past the ones before.
    offsets = [0]
    for layer in layers[:-1]:
        offsets.append(offsets[-1] + layer.size(0) // PAGE)
    pool = torch.cat(layers)
    tables = [table + offset for table, offset in zip(tables, offsets, strict=True)]
    rows = sum(length for length, _ in sequences)
    q = (torch.randn(rows, heads, dim, generator=gen, dtype=torch.float64) * 4).round() / 4
    q = q.to(dtype)
    weights = torch.randn(rows, heads, generator=gen) * heads**-0.5
    batch = batch_of(sequences, tables)

    class Config:
        index_topk, index_head_dim = topk, dim

    fast = dsa_indexer.select_topk(q, weights, pool, batch, Config)
    reference = dsa_reference.select_topk(q, weights, pool, batch, topk, dim)
    assert torch.equal(fast, reference)


def test_top_k_equals_the_reference():
    gen = torch.Generator().manual_seed(3)
    k = 16
    for n in (k, 3 * k, 8 * k, 8 * k + 1, 40 * k):
        rows = torch.randn(12, n, generator=gen).float()
        rows[0] = (rows[0] * 3).round()  # ties everywhere
        rows[1] = 0.0  # flat: all tied at the peak
        rows[2] = -1.0
        rows[2, torch.randperm(n, generator=gen)[:k]] = 0.0  # exactly k at the peak
        rows[3] = -1.0
        rows[3, ::9] = 0.0  # more than k at the peak, sparse past the searched prefix
        rows[4, : n // 2] = float("-inf")  # masked tokens
        rows[5] = float("-inf")
        rows[5, : k // 2] = 1.0  # fewer visible tokens than k
        rows[6] = rows[6].relu()  # ties at zero below positive scores
        rows[7] = rows[7].clamp(max=0.5)  # ties at the peak, fewer or more than k
        rows[8] = -rows[8].abs()
        rows[8, -1] = 0.0  # one peak, then distinct scores
        assert torch.equal(top_k(rows, k), dsa_reference.top(rows.clone(), k)), n


def test_sparse_attention_equals_the_reference(monkeypatch):
    monkeypatch.setattr(mla_attention, "SCORE_BLOCK_ELEMENTS", 1 << 14)
    monkeypatch.setattr(mla_attention, "GATHER_ELEMENTS", 1 << 11)
    gen = torch.Generator().manual_seed(7)
    heads, nope, rope, rank, v, k = 2, 8, 8, 16, 8, 32
    # A prefill chunk (copies its context once), decode rows (gather by slot).
    sequences = [(250, 700), (1, 400), (1, 900)]
    # The sequences share their prefix's pages.
    latent = torch.randn(900, rank + rope, generator=gen, dtype=torch.float64)
    pool, table = paged(latent, gen)
    tables = [table[: -(-context // PAGE)] for _, context in sequences]
    rows = sum(length for length, _ in sequences)
    position = torch.cat([torch.arange(c - n, c) for n, c in sequences])
    last = torch.cat([torch.full((n,), c - 1) for n, c in sequences])
    # Some past a row's position (a row that sees fewer tokens than k), pads.
    topk = torch.rand(rows, k, generator=gen, dtype=torch.float64) * (position[:, None] + 20)
    topk = torch.minimum(topk.long(), last[:, None])
    topk[::5, -3:] = -1
    q_nope = torch.randn(rows, heads, nope, generator=gen, dtype=torch.float64)
    q_rot = torch.randn(rows, heads, rope, generator=gen, dtype=torch.float64)
    w_uk = torch.randn(heads, nope, rank, generator=gen, dtype=torch.float64)
    w_uv = torch.randn(heads, v, rank, generator=gen, dtype=torch.float64)
    batch = batch_of(sequences, tables)
    args = (q_nope, q_rot, pool, w_uk, w_uv, batch, 0.3, topk)
    assert torch.equal(mla_attention.mla_attend(*args), dsa_reference.sparse_attend(*args))
