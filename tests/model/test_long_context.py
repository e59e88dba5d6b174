"""Memory-bounded attention over long cached contexts: the paged online-softmax
backend against the dense SDPA path (the previous backend) and against HF in
float64, with contexts crossing the attention chunk and the prefill chunk
several times, and the bounds themselves (query rows per forward, keys per
attention block)."""

import pytest
import torch

from kvrelay.model import Request, SamplingParams, load_engine, paged_attention
from kvrelay.model.attention import AttentionBatch, TorchSDPABackend
from kvrelay.model.paged_attention import (
    PagedOnlineSoftmaxBackend,
    attend_block,
    attend_block_reference,
)
from tests.model.oracle import hf_greedy, hf_model
from tests.support.models import prompt_tokens

EXACT = 1e-9


def max_diff(a, b) -> float:
    return float((a.to(torch.float64) - b.to(torch.float64)).abs().max())


def random_pool(pages: int, page_size: int, kv_heads: int, dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    shape = (pages * page_size, kv_heads, dim)
    k = torch.randn(shape, generator=gen, dtype=torch.float64)
    v = torch.randn(shape, generator=gen, dtype=torch.float64)
    return k, v


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_fused_block_equals_reference(causal, kv_heads):
    gen = torch.Generator().manual_seed(kv_heads)
    q = torch.randn(4, 37, 16, generator=gen, dtype=torch.float64)
    length = 37 if causal else 300
    k = torch.randn(kv_heads, length, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(kv_heads, length, 16, generator=gen, dtype=torch.float64)
    out, lse = attend_block(q, k, v, 0.25, causal)
    ref_out, ref_lse = attend_block_reference(q, k, v, 0.25, causal)
    assert max_diff(out, ref_out) < 1e-12
    assert max_diff(lse, ref_lse) < 1e-12


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_paged_backend_equals_dense_path(kv_heads):
    """Mixed batch (decode rows, a prefill over a cached prefix, a cold prompt,
    an unaligned cached length), pages scattered and partly consecutive."""
    ps, dim, q_heads = 16, 8, 4
    k_pool, v_pool = random_pool(200, ps, kv_heads, dim, seed=kv_heads)
    perm = torch.randperm(200, generator=torch.Generator().manual_seed(7))
    shapes = [(1, 700), (90, 1000), (50, 50), (33, 419), (1, 1)]  # (query, context)
    tables, starts, row = [], [], 0
    used = 0
    for index, (length, context) in enumerate(shapes):
        n = -(-context // ps)
        # Every other table consecutive: the in-place view path and the gather path.
        pages = torch.arange(used, used + n) if index % 2 else perm[used : used + n]
        tables.append(pages.to(torch.int64))
        used += n
        starts.append(row)
        row += length
    batch = AttentionBatch(
        tuple(starts),
        tuple(s[0] for s in shapes),
        tuple(s[1] for s in shapes),
        tuple(tables),
        page_size=ps,
    )
    q = torch.randn(row, q_heads, dim, generator=torch.Generator().manual_seed(3)).double()
    want = TorchSDPABackend().attend(q, k_pool, v_pool, batch, 0.3)
    for chunk in (16, 100, 256, 1 << 20):
        for invariant in (False, True):
            backend = PagedOnlineSoftmaxBackend(chunk, batch_invariant=invariant)
            got = backend.attend(q, k_pool, v_pool, batch, 0.3)
            assert max_diff(got, want) < 1e-12, (chunk, invariant)


def test_attention_blocks_are_bounded_by_the_chunk(monkeypatch):
    seen = []

    def spy(q, k, v, scale, causal):
        seen.append(k.size(1))
        return attend_block_reference(q, k, v, scale, causal)

    monkeypatch.setattr(paged_attention, "attend_block", spy)
    ps = 16
    k_pool, v_pool = random_pool(80, ps, 2, 8, seed=1)
    batch = AttentionBatch((0,), (4,), (1200,), (torch.arange(80),), page_size=ps)
    q = torch.randn(4, 4, 8, dtype=torch.float64)
    PagedOnlineSoftmaxBackend(64).attend(q, k_pool, v_pool, batch, 0.3)
    # 1196 cached keys in blocks of 64, plus the 4 new ones.
    assert max(seen) == 64
    assert sum(seen) == 1200


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-mha"])
def test_long_cached_context_matches_hf(model_dirs, name):
    """A 700-token prompt, page size 16, attention chunks of 64 tokens and
    prefill chunks of 96 tokens: cold, then over a cached 517-token prefix."""
    model_dir = model_dirs(name, max_positions=1024)
    prompt = prompt_tokens(700, seed=11)
    oracle = hf_greedy(hf_model(model_dir), prompt, 12)
    options = dict(dtype="float64", page_size=16, num_pages=120)
    engine = load_engine(model_dir, **options, max_prefill_tokens=96, attention_chunk_tokens=64)
    rows = []
    original = engine.shard.forward
    engine.shard.forward = lambda batch: rows.append(batch.token_ids.numel()) or original(batch)

    cold = engine.generate([Request(prompt, SamplingParams(12), return_logits=True)])[0]
    assert max(rows) == 96  # chunked: 700 tokens in 8 forwards
    assert max_diff(cold.prompt_logits, oracle.prompt_logits) < EXACT
    assert cold.tokens == oracle.tokens
    assert max_diff(torch.stack(cold.step_logits), torch.stack(oracle.step_logits)) < EXACT

    engine.pool.clear_cache()
    engine.generate([Request(prompt[:517], SamplingParams(1))])
    warm = engine.generate([Request(prompt, SamplingParams(12), return_logits=True)])[0]
    assert warm.cached_tokens == 517
    assert max_diff(warm.prompt_logits, oracle.prompt_logits[517:]) < EXACT
    assert warm.tokens == oracle.tokens
    assert max_diff(torch.stack(warm.step_logits), torch.stack(oracle.step_logits)) < EXACT


def test_chunked_batch_prefill_equals_one_forward(model_dirs):
    """Several prompts split across forwards mid-sequence give the same
    tokens and logits as one unchunked forward."""
    model_dir = model_dirs("llama-gqa")
    prompts = [prompt_tokens(n, seed=n) for n in (130, 45, 201)]
    requests = [Request(p, SamplingParams(6), return_logits=True) for p in prompts]
    options = dict(dtype="float64", page_size=16, num_pages=64)
    whole = load_engine(model_dir, **options, max_prefill_tokens=10_000).generate(requests)
    chunked = load_engine(model_dir, **options, max_prefill_tokens=50).generate(
        [Request(p, SamplingParams(6), return_logits=True) for p in prompts]
    )
    for a, b in zip(whole, chunked, strict=True):
        assert a.tokens == b.tokens
        assert max_diff(a.prompt_logits, b.prompt_logits) < 1e-12


def test_bad_chunk_sizes_are_refused(model_dirs):
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        load_engine(model_dirs("llama-gqa"), max_prefill_tokens=0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        PagedOnlineSoftmaxBackend(0)
