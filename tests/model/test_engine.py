"""Engine behaviour: batching, prefix reuse, stop conditions, sampling, errors."""

import pytest
import torch

from kvrelay.model import (
    PoolExhausted,
    Request,
    RequestError,
    SamplingParams,
    load_engine,
)
from tests.support.models import prompt_tokens


@pytest.fixture
def engine(model_dirs):
    return load_engine(model_dirs("llama-gqa"), dtype="float64", page_size=16, num_pages=40)


def test_a_batch_matches_requests_run_alone(engine):
    prompts = [prompt_tokens(n, seed=n) for n in (5, 40, 33, 16)]
    alone = [engine.generate([Request(p, SamplingParams(12))])[0].tokens for p in prompts]
    engine.pool.clear_cache()
    batch = engine.generate([Request(p, SamplingParams(12)) for p in prompts])
    assert [r.tokens for r in batch] == alone


def test_second_request_computes_only_its_suffix(engine, model_dirs):
    shared = prompt_tokens(48, seed=1)
    first = engine.generate([Request([*shared, 1, 2, 3], SamplingParams(4))])[0]
    assert first.cached_tokens == 0
    second = engine.generate([Request([*shared, 9, 9], SamplingParams(4), return_logits=True)])[0]
    assert second.cached_tokens == 48
    assert second.prompt_logits.shape[0] == 2  # only the suffix ran
    cold = load_engine(model_dirs("llama-gqa"), dtype="float64", page_size=16)
    want = cold.generate([Request([*shared, 9, 9], SamplingParams(4), return_logits=True)])[0]
    assert second.tokens == want.tokens
    torch.testing.assert_close(second.prompt_logits, want.prompt_logits[48:], rtol=0, atol=1e-12)


def test_generated_tokens_pages_are_indexed_too(engine):
    prompt = prompt_tokens(10, seed=2)
    out = engine.generate([Request(prompt, SamplingParams(30))])[0]
    # 10 + 30 tokens; KV exists for the first 39: two full pages and the
    # partial third (7 tokens) are indexed.
    assert engine.pool.cached_pages == 3
    follow = engine.generate([Request(prompt + out.tokens, SamplingParams(1))])[0]
    assert follow.cached_tokens == 39
    # A continuation that differs inside the partial page reuses only the full pages.
    other = prompt + out.tokens[:25] + [(out.tokens[25] + 1) % 256, 5]
    assert engine.generate([Request(other, SamplingParams(1))])[0].cached_tokens == 32


def test_a_fully_cached_prompt_still_computes_its_last_token(engine):
    prompt = prompt_tokens(32, seed=3)
    want = engine.generate([Request(prompt, SamplingParams(3))])[0]
    again = engine.generate([Request(prompt, SamplingParams(3))])[0]
    assert again.cached_tokens == 16
    assert again.tokens == want.tokens


def test_stop_token_ends_the_request(engine):
    prompt = prompt_tokens(20, seed=4)
    free = engine.generate([Request(prompt, SamplingParams(10))])[0].tokens
    stop = free[3]
    out = engine.generate([Request(prompt, SamplingParams(10, stop_token_ids=(stop,)))])[0]
    assert out.tokens == free[: free.index(stop) + 1]
    assert out.finish_reason == "stop"
    assert engine.generate([Request(prompt, SamplingParams(10))])[0].finish_reason == "length"


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(engine):
    prompt = prompt_tokens(20, seed=5)
    params = SamplingParams(16, temperature=1.0, top_p=0.9, top_k=50, seed=7)
    a = engine.generate([Request(prompt, params)])[0].tokens
    b = engine.generate([Request(prompt, params)])[0].tokens
    c = engine.generate([Request(prompt, SamplingParams(16, temperature=1.0, seed=8))])[0].tokens
    greedy = engine.generate([Request(prompt, SamplingParams(16))])[0].tokens
    top1 = SamplingParams(16, temperature=1.0, top_k=1, seed=9)
    assert a == b
    assert a != c
    assert engine.generate([Request(prompt, top1)])[0].tokens == greedy
    tiny_p = SamplingParams(16, temperature=1.0, top_p=1e-9, seed=9)
    assert engine.generate([Request(prompt, tiny_p)])[0].tokens == greedy


def test_pool_exhaustion_is_typed_and_returns_every_page(engine):
    free = engine.pool.free_pages
    small = Request(prompt_tokens(40, seed=6), SamplingParams(8))
    huge = Request(prompt_tokens(600, seed=6), SamplingParams(100))
    with pytest.raises(PoolExhausted) as caught:
        engine.generate([small, huge])
    assert caught.value.needed == 44
    assert engine.pool.free_pages == free
    # The scheduler can run what fits.
    assert engine.generate([small])[0].tokens


@pytest.mark.parametrize(
    "request_",
    [
        Request([], SamplingParams(4)),
        Request([1, 256], SamplingParams(4)),
        Request([-1], SamplingParams(4)),
    ],
    ids=["empty", "too-large", "negative"],
)
def test_bad_requests_are_rejected_and_return_pages(engine, request_):
    good = Request(prompt_tokens(30), SamplingParams(4))
    free = engine.pool.free_pages
    with pytest.raises(RequestError):
        engine.generate([good, request_])
    assert engine.pool.free_pages == free


@pytest.mark.parametrize(
    "kwargs",
    [{"max_new_tokens": 0}, {"temperature": -1.0}, {"top_k": -1}, {"top_p": 0.0}],
)
def test_bad_sampling_values_are_rejected(kwargs):
    with pytest.raises(RequestError):
        SamplingParams(**kwargs)


def test_failure_in_the_middle_of_a_batch_returns_pages(engine, monkeypatch):
    free = engine.pool.free_pages

    def broken(batch):
        raise RuntimeError("backend failed")

    monkeypatch.setattr(engine.shard, "forward", broken)
    with pytest.raises(RuntimeError, match="backend failed"):
        engine.generate([Request(prompt_tokens(50), SamplingParams(4))])
    assert engine.pool.free_pages == free
