"""A prefill/decode pair over the ucx backend (shared memory and cma on one
host), the no-cache baseline, drain, and a clean SIGTERM (deregistration)."""

from __future__ import annotations

import asyncio

import pytest

from kvrelay.model import Request, load_engine
from tests.serving import fake_control as fc
from tests.serving.conftest import DTYPE, PAGE, worker_args
from tests.support.models import prompt_tokens

ucx = pytest.importorskip("kvrelay._ucx", reason="kvrelay._ucx was not built")

UCX_ENV = {"UCX_TLS": "sm,self"}
STAGING = 8


@pytest.fixture(scope="module")
def pair(launch, control, model_dir):
    """No tier: prefill without its pool's prefix index (the baseline), decode normal."""
    # Staging for two 4-page prompts at a time, at most 3 requests queued.
    extra = ["--no-local-cache", "--staging-pages", STAGING, "--max-queue", 3]
    prefill = launch(
        *worker_args("prefill", model_dir, control, backend="ucx", extra=extra),
        env=UCX_ENV,
        wait=False,
    )
    decode = launch(*worker_args("decode", model_dir, control, backend="ucx"), env=UCX_ENV)
    prefill.ready()
    return prefill, decode


@pytest.mark.asyncio
async def test_ucx_pair_matches_one_process_without_any_cache(pair, model_dir):
    prefill, decode = pair
    prompt = prompt_tokens(3 * PAGE + 7, seed=31)
    sampling = fc.params(10, temperature=0.8, top_p=0.95, seed=8)
    engine = load_engine(model_dir, dtype=DTYPE, page_size=PAGE, num_pages=64)
    want = engine.generate([Request(prompt, fc.sampling_params(sampling))])[0].tokens
    for rid in ("u1", "u2"):  # the same prompt twice: the baseline computes it twice
        got = await fc.serve(fc.addr(prefill), fc.addr(decode), rid, prompt, sampling)
        assert got["ok"], got
        assert got["tokens"] == want
        assert got["prefill"]["cached_tokens"] == {"local": 0, "tier": 0}
        assert got["done"]["pulled"]["prefill_pages"] + got["done"]["pulled"]["local_pages"] == 4
    stats = (await fc.call(fc.addr(prefill), {"op": "stats"}))["stats"]
    assert stats["computed_tokens"] == 2 * len(prompt) and stats["local_hit_tokens"] == 0


@pytest.mark.asyncio
async def test_staging_rows_held_by_handles_hold_back_the_queue(pair):
    prefill, _ = pair
    prompt = prompt_tokens(3 * PAGE + 2, seed=40)  # 4 pages: two fit in staging

    async def burst():
        return await asyncio.gather(
            *(
                fc.prefill(fc.addr(prefill), f"b{i}", prompt, fc.params(4), lease_s=1.0)
                for i in range(6)
            )
        )

    replies = await burst()
    served = [r for r in replies if r["ok"]]
    busy = [r for r in replies if not r["ok"]]
    assert busy and all(r["error"] == "Busy" for r in busy)
    assert len(served) >= 3
    # The third waited for the first two handles' leases to run out.
    assert max(r["timings"]["queue_s"] for r in served) > 0.5
    # Nine new pages can never fit eight staging rows: refused up front.
    too_big = await fc.prefill(fc.addr(prefill), "big", prompt_tokens(9 * PAGE), fc.params())
    assert too_big["error"] == "StagingTooSmall"

    async def staging_free():
        return (await fc.call(fc.addr(prefill), {"op": "stats"}))["stats"]["staging_free"]

    async def wait_for_rows():
        async with asyncio.timeout(10):
            while await staging_free() != STAGING:
                await asyncio.sleep(0.1)

    await wait_for_rows()  # every lease expired: every row is back


@pytest.mark.asyncio
async def test_drain_then_sigterm_deregisters(pair, control):
    prefill, decode = pair
    assert (await fc.call(fc.addr(prefill), {"op": "drain"}))["op"] == "ok"
    reply = await fc.prefill(fc.addr(prefill), "late", [1, 2, 3], fc.params(4))
    assert reply["error"] == "Busy"
    for worker in (prefill, decode):
        node_id = worker.info["node_id"]
        assert node_id in control.nodes
        assert worker.stop() == 0
        assert node_id in control.deleted and node_id not in control.nodes
