"""A decode worker with `--speculative K` behind a real prefill worker: the
greedy tokens equal a plain single-process run, two requests decode in one
batch, and the speculation counts reach the done frame and the stats."""

from __future__ import annotations

import asyncio

import pytest

from kvrelay.model import Request, SamplingParams, load_engine
from tests.serving import fake_control as fc
from tests.serving.conftest import DTYPE, PAGE, worker_args
from tests.support.models import prompt_tokens


@pytest.fixture(scope="module")
def mtp_model(model_dirs):
    return model_dirs("serving", mtp=1)


@pytest.mark.asyncio
async def test_speculating_decode_worker_equals_plain_greedy(launch, control, mtp_model):
    prefill = launch(*worker_args("prefill", mtp_model, control), wait=False)
    decode = launch(*worker_args("decode", mtp_model, control, extra=["--speculative", 2]))
    prompts = [prompt_tokens(2 * PAGE + 7, seed=41), prompt_tokens(PAGE + 3, seed=42)]
    sampling = fc.params(16)
    engine = load_engine(mtp_model, dtype=DTYPE, page_size=PAGE, num_pages=64)
    expected = [engine.generate([Request(p, SamplingParams(16))])[0].tokens for p in prompts]

    async def both():
        return await asyncio.gather(
            *(
                fc.serve(prefill.info["address"], decode.info["address"], f"s{i}", p, sampling)
                for i, p in enumerate(prompts)
            )
        )

    results = await both()
    for got, tokens in zip(results, expected, strict=True):
        assert got["ok"], got
        assert got["tokens"] == tokens
        spec = got["done"]["spec"]
        assert spec["steps"] > 0 and 0 <= spec["accepted"] <= spec["proposed"]
    reply = await fc.call(decode.info["address"], {"op": "stats"})
    stats = reply["stats"]
    assert stats["spec_proposed"] == sum(r["done"]["spec"]["proposed"] for r in results)
    assert stats["spec_accepted"] == sum(r["done"]["spec"]["accepted"] for r in results)
