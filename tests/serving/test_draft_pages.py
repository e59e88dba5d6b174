"""Draft (MTP) pages through real workers and a real cache server: a
speculating decode restores the draft's KV that a CP=2 prefill staged (P->D), or
that a TP=2 prefill wrote to the tier, and its proposed and accepted counts
equal a cold run's; zeroed draft pages in the tier change them (the test can
fail); target pages in the tier without their draft pages are recomputed.

The model has one layer and an MTP layer copied from it (`mtp_init="copy"`),
so the draft agrees with the target often and the counts say something: a
Llama, and a GLM-5-shaped model (MLA, DSA indexer with top-k below the
prompts, MoE) whose draft pages carry the MTP layer's latent and indexer keys
and do not divide its target pages."""

from __future__ import annotations

import pytest

from kvrelay.cache.client import CacheClient, CacheClientConfig
from kvrelay.layout import ParallelConfig, draft_rectangle, rank_rectangle
from kvrelay.model import Request, SamplingParams, load_engine
from kvrelay.model.draft_transfer import draft_keys, export_draft_prefix
from kvrelay.model.page_export import export_prefix
from kvrelay.transfer import create_agent
from tests.serving import fake_control as fc
from tests.serving.conftest import DTYPE, PAGE, all_ready, cache_args, worker_args
from tests.support.models import prompt_tokens

NEW = 12  # tokens per request (first token included)


@pytest.fixture(scope="module", params=["llama", "glm5"])
def mtp_model(request, model_dirs, tmp_path_factory):
    if request.param == "llama":
        return model_dirs("serving", layers=1, mtp=1, mtp_init="copy")
    from kvrelay.model.make_mla_model import MlaModelSpec, write_mla_model

    spec = MlaModelSpec(arch="glm5", layers=1, first_dense=0, mtp=1, mtp_init="copy",
                        index_topk=24, std=0.2, seed=31)  # fmt: skip
    return write_mla_model(tmp_path_factory.mktemp("glm5-mtp") / "model", spec)


def spec_engine(mtp_model):
    return load_engine(mtp_model, dtype=DTYPE, page_size=PAGE, num_pages=32, speculative=2)


@pytest.fixture(scope="module")
def cluster(launch, control, mtp_model):
    page_bytes = spec_engine(mtp_model).spec.page_bytes
    cache = launch(*cache_args(page_bytes)).info["listen"]

    def worker(role, k, cache=(cache,), tp=1, cp=1):
        extra = ["--speculative", k, *(["--cp", cp] if cp > 1 else [])]
        args = worker_args(role, mtp_model, control, tp=tp, cache=cache, extra=extra)
        return launch(*args, wait=False)

    workers = {
        "prefill_cp2_no_tier": worker("prefill", 1, cache=(), cp=2),
        "prefill_tp2": worker("prefill", 1, tp=2),
        "decode": worker("decode", 2),
    }
    all_ready(workers.values())
    return {"cache": cache, **workers}


def cold(mtp_model, prompt: list[int]) -> tuple[list[int], dict]:
    """One process, nothing cached: the first token, then prompt + first token
    speculated from scratch (the steps a decode worker takes)."""
    plain = load_engine(mtp_model, dtype=DTYPE, page_size=PAGE, num_pages=32)
    first = plain.generate([Request(prompt, SamplingParams(1))])[0].tokens[0]
    result = spec_engine(mtp_model).generate(
        [Request([*prompt, first], SamplingParams(NEW - 1), skip_draws=1)]
    )[0]
    greedy = plain.generate([Request(prompt, SamplingParams(NEW))])[0].tokens
    assert [first, *result.tokens] == greedy
    return greedy, result.spec


async def serve(cluster, prefill: str, prompt: list[int], rid: str) -> dict:
    got = await fc.serve(cluster[prefill].info["address"], cluster["decode"].info["address"],
                         rid, prompt, fc.params(NEW))  # fmt: skip
    assert got["ok"], got
    return got


@pytest.mark.asyncio
async def test_draft_pages_from_cp2_prefill_handles(cluster, mtp_model):
    """A CP=2 prefill without a tier: each CP rank publishes the draft pages
    it owns (i % 2), decode reads them all from the two handles."""
    prompt = prompt_tokens(3 * PAGE + 5, seed=71)
    tokens, spec = cold(mtp_model, prompt)
    got = await serve(cluster, "prefill_cp2_no_tier", prompt, "h1")
    drafts = [h for h in got["prefill"]["handles"] if h.get("draft")]
    assert sorted(p for h in drafts for p in h["pages"]) == [0, 1, 2]
    pulled = got["done"]["draft_pulled"]
    assert pulled == {"local_pages": 0, "tier_pages": 0, "prefill_pages": 3}
    assert got["tokens"] == tokens
    assert got["done"]["spec"] == spec


@pytest.mark.asyncio
async def test_draft_pages_written_by_tp2_prefill_through_the_tier(cluster, mtp_model):
    prompt = prompt_tokens(2 * PAGE + 9, seed=72)
    tokens, spec = cold(mtp_model, prompt)
    got = await serve(cluster, "prefill_tp2", prompt, "t1")
    pulled = got["done"]["draft_pulled"]
    assert pulled == {"local_pages": 0, "tier_pages": 2, "prefill_pages": 0}
    assert got["tokens"] == tokens
    assert got["done"]["spec"] == spec


async def write_to_tier(cache: str, mtp_model, prompt: list[int], pages: int, draft: str) -> None:
    """Writes the prompt's first `pages` target pages to the tier as a worker
    would, and their draft pages as computed ("true"), zeroed ("zero") or not
    at all ("none")."""
    engine = spec_engine(mtp_model)
    engine.generate([Request(prompt, SamplingParams(1))])
    flat = ParallelConfig()
    pb, dspec = engine.spec.page_bytes, engine.draft.spec
    agent = await create_agent("tcp", token=fc.TOKEN)
    arena = agent.allocate_arena(2 * pages * pb)
    rows = arena.tensor.view(2 * pages, pb)
    export_prefix(engine, prompt[: pages * PAGE], rows, list(range(pages)))
    config = CacheClientConfig((cache,), fc.TOKEN)
    target = CacheClient(agent, engine.spec, rank_rectangle(engine.spec, flat), config)
    offsets = [i * pb for i in range(2 * pages)]
    await target.write(engine.spec.page_keys(prompt)[:pages], arena, offsets[:pages])
    if draft != "none":
        # Each draft page at the start of a row (a row's stride: an MLA draft
        # page with indexer keys need not divide the target page).
        ids = list(range(pages, 2 * pages))
        export_draft_prefix(engine, prompt[: pages * PAGE + 1], rows[:, : dspec.page_bytes], ids)
        if draft == "zero":
            rows[pages:].zero_()
        client = CacheClient(agent, dspec, draft_rectangle(dspec, flat), config, slot_bytes=pb)
        keys = draft_keys(engine, prompt[: pages * PAGE + 1])
        await client.write(keys, arena, offsets[pages:])
        await client.close()
    await target.close()
    await agent.close()


@pytest.mark.asyncio
async def test_zeroed_draft_pages_in_the_tier_change_the_counts(cluster, mtp_model):
    """The negative control: the same path with the draft pages' bytes zeroed."""
    prompt = prompt_tokens(2 * PAGE + 9, seed=73)
    tokens, spec = cold(mtp_model, prompt)
    await write_to_tier(cluster["cache"], mtp_model, prompt, 2, draft="zero")
    got = await serve(cluster, "prefill_tp2", prompt, "z1")
    assert got["prefill"]["cached_tokens"]["tier"] == 2 * PAGE
    assert got["done"]["draft_pulled"]["tier_pages"] == 2
    assert got["tokens"] == tokens  # verification is exact whatever the draft says
    assert got["done"]["spec"] != spec


@pytest.mark.asyncio
async def test_target_hit_draft_miss_recomputes_from_the_first_missing_draft_page(
    cluster, mtp_model
):
    prompt = prompt_tokens(2 * PAGE + 9, seed=74)
    tokens, spec = cold(mtp_model, prompt)
    await write_to_tier(cluster["cache"], mtp_model, prompt, 2, draft="none")
    got = await serve(cluster, "prefill_tp2", prompt, "m1")
    # Prefill found the target pages but not the draft's: it computed the
    # whole prompt, then staged and wrote the draft pages decode took.
    assert got["prefill"]["cached_tokens"]["tier"] == 0
    assert got["done"]["draft_pulled"]["tier_pages"] == 2
    assert got["tokens"] == tokens
    assert got["done"]["spec"] == spec
