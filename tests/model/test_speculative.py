"""Speculative decoding with the MTP layer: greedy output equals plain greedy
token for token (K in 1, 2, 4, continuous batching, TP x PP), the sampling
rule reproduces the target distribution, rejected tokens' KV is rolled back."""

import pytest
import torch

from kvrelay.model import Request, SamplingParams, load_engine
from kvrelay.model.page_export import export_prefix
from kvrelay.model.parallel import ParallelEngine
from kvrelay.model.sampling import Sampler
from kvrelay.model.speculative import verify
from tests.support.models import prompt_tokens

PAGE = 16
NEW = 40
SAMPLED = SamplingParams(24, temperature=0.8, top_k=40, top_p=0.9, seed=5)


def engine(model_dir, k=0, **options):
    return load_engine(
        model_dir, dtype="float64", page_size=PAGE, num_pages=64, speculative=k, **options
    )


@pytest.fixture(scope="module")
def plain(model_dirs):
    model_dir = model_dirs("qwen2-gqa", mtp=1)
    prompts = [prompt_tokens(3 * PAGE + 5, seed=11), prompt_tokens(PAGE + 3, seed=12)]
    results = engine(model_dir).generate([Request(p, SamplingParams(NEW)) for p in prompts])
    return model_dir, prompts, [r.tokens for r in results]


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_speculation_equals_plain_greedy_with_continuous_batching(plain, k):
    model_dir, prompts, expected = plain
    spec = engine(model_dir, k)
    first = spec.admit(Request(prompts[0], SamplingParams(NEW)))
    tokens = {first: []}
    for _ in range(3):
        for out in spec.step():
            tokens[out.seq_id] += out.tokens
    # A second sequence joins the speculating batch mid-way.
    second = spec.admit(Request(prompts[1], SamplingParams(NEW)))
    tokens[second] = []
    while spec.running:
        for out in spec.step():
            tokens[out.seq_id] += out.tokens
            assert 1 <= len(out.tokens) <= k + 1
    assert tokens[first] == expected[0]
    assert tokens[second] == expected[1]
    assert spec.pool.free_pages == spec.pool.num_pages
    assert spec.draft.pool.free_pages == spec.draft.pool.num_pages


def test_stats_and_stop_tokens(plain):
    model_dir, prompts, expected = plain
    stop = expected[0][20]
    result = engine(model_dir, 4).generate(
        [Request(prompts[0], SamplingParams(NEW, stop_token_ids=(stop,)))]
    )[0]
    cut = expected[0].index(stop) + 1
    assert result.tokens == expected[0][:cut] and result.finish_reason == "stop"
    spec = result.spec
    assert 0 <= spec["accepted"] <= spec["proposed"] <= 4 * spec["steps"]
    assert spec["steps"] + spec["accepted"] >= len(result.tokens) - 1


@pytest.mark.cluster  # starts rank or CLI processes
def test_tp_pp_speculation_matches_one_process(model_dirs):
    model_dir = model_dirs("parallel", mtp=1)
    prompt = prompt_tokens(4 * PAGE + 9, seed=21)
    requests = [Request(prompt, SamplingParams(NEW)), Request(prompt[:30], SAMPLED)]
    expected = engine(model_dir).generate(requests[:1])[0].tokens
    single = engine(model_dir, 2).generate(requests)
    assert single[0].tokens == expected
    with ParallelEngine(
        model_dir, tp=2, pp=2, dtype="float64", page_size=PAGE, num_pages=64, speculative=2
    ) as group:
        results = group.generate(requests)
    assert results[0].tokens == expected
    assert results[1].tokens == single[1].tokens
    assert [r.spec for r in results] == [r.spec for r in single]


@pytest.mark.cluster  # starts rank or CLI processes
def test_speculation_after_a_context_parallel_prefill_matches_one_process(model_dirs):
    """CP=2 prefill (the MTP layer runs whole on each CP rank over the
    gathered hidden states), then CP=1-style decode steps on every rank."""
    model_dir = model_dirs("parallel", mtp=1)
    prompts = [prompt_tokens(3 * PAGE + 9, seed=22), prompt_tokens(PAGE + 5, seed=23)]
    requests = [Request(p, SamplingParams(NEW // 2)) for p in prompts]
    expected = [r.tokens for r in engine(model_dir).generate(requests)]
    single = engine(model_dir, 2).generate(requests)
    with ParallelEngine(
        model_dir, cp=2, dtype="float64", page_size=PAGE, num_pages=64, speculative=2
    ) as group:
        results = group.generate(requests)
    assert [r.tokens for r in results] == expected
    assert [r.spec for r in results] == [r.spec for r in single]


def test_rejected_tokens_leave_no_trace_in_the_pages(plain):
    """The pages of prompt + answer after speculation equal a plain run's."""
    model_dir, prompts, expected = plain
    sequence = prompts[0] + expected[0]
    arenas = []
    for k in (0, 4):
        run = engine(model_dir, k)
        run.generate([Request(prompts[0], SamplingParams(NEW))])
        pages = -(-(len(sequence) - 1) // PAGE)
        arena = torch.zeros(pages, run.spec.page_bytes, dtype=torch.uint8)
        export_prefix(run, sequence[:-1], arena)
        arenas.append(arena.view(torch.float64))
    assert float((arenas[0] - arenas[1]).abs().max()) < 1e-9


def test_rejection_rule_reproduces_the_target_distribution():
    """Accept d with p(d), else draw from p without d: the first emitted token
    is distributed as p, whatever d is."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0], dtype=torch.float64)
    params = SamplingParams(4, temperature=1.0, seed=3)
    sampler = Sampler(params)
    p = sampler.probs(logits)
    draws = 20000
    for proposal in (0, 3):
        counts = torch.zeros(5)
        rows = torch.stack([logits, logits])
        for _ in range(draws):
            counts[verify(sampler, rows, [proposal])[0]] += 1
        assert float((counts / draws - p).abs().max()) < 0.015
