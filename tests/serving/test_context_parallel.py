"""A context-parallel prefill worker (`launch prefill --cp 2`) as real processes
with a real cache server: decode gets the tokens of one process's run, every
page is staged and written to the tier once (by its CP rank), the pages it
wrote are a full tier hit for a CP=1 prefill, and decode refuses --cp."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvrelay.model import Request, SamplingParams, load_engine
from tests.serving import fake_control as fc
from tests.serving.conftest import DTYPE, PAGE, all_ready, cache_args, worker_args
from tests.support.models import prompt_tokens


@pytest.fixture(scope="module")
def cluster(launch, control, model_dir, page_bytes):
    cache = launch(*cache_args(page_bytes)).info["listen"]

    def worker(role, cache=(cache,), extra=()):
        return launch(*worker_args(role, model_dir, control, cache=cache, extra=extra), wait=False)

    workers = {
        "prefill_cp2": worker("prefill", extra=["--cp", 2]),
        "prefill": worker("prefill"),
        "decode": worker("decode"),
        "decode_no_tier": worker("decode", cache=()),
    }
    all_ready(workers.values())
    return workers


def reference(model_dir, prompt, sampling) -> list[int]:
    engine = load_engine(model_dir, dtype=DTYPE, page_size=PAGE)
    params = SamplingParams(sampling["max_new_tokens"], seed=sampling["seed"] or 0)
    return engine.generate([Request(prompt, params)])[0].tokens


async def bytes_to_tier(process) -> int:
    reply = await fc.call(fc.addr(process), {"op": "stats"})
    assert reply["ok"], reply
    return reply["stats"]["bytes_to_tier"]


@pytest.mark.asyncio
async def test_cp2_prefill_serves_decode_and_writes_each_page_once(cluster, model_dir, page_bytes):
    prompt = prompt_tokens(3 * PAGE + 5, seed=61)
    sampling = fc.params(10)
    before = await bytes_to_tier(cluster["prefill_cp2"])
    got = await fc.serve(
        fc.addr(cluster["prefill_cp2"]), fc.addr(cluster["decode"]), "c1", prompt, sampling
    )
    assert got["ok"], got
    assert got["tokens"] == reference(model_dir, prompt, sampling)
    answer = got["prefill"]
    assert answer["spec"] == {"tp": 1, "pp": 1, "cp": 2}
    # One handle per CP rank, each holding the pages it owns.
    assert sorted(h["pages"] for h in answer["handles"]) == [[0, 2], [1, 3]]
    assert answer["tier_pages"] == 3
    # Three full pages through to the tier, each by one CP rank: written once.
    assert await bytes_to_tier(cluster["prefill_cp2"]) - before == 3 * page_bytes
    assert got["done"]["pulled"] == {"local_pages": 0, "tier_pages": 3, "prefill_pages": 1,
                                     "recomputed_pages": 0}  # fmt: skip

    # Written at CP=2, a full hit for a CP=1 prefill worker (no CP in any key).
    again = await fc.serve(
        fc.addr(cluster["prefill"]), fc.addr(cluster["decode"]), "c2", prompt, sampling
    )
    assert again["ok"], again
    assert again["prefill"]["cached_tokens"] == {"local": 0, "tier": 3 * PAGE}
    assert again["tokens"] == got["tokens"]


@pytest.mark.asyncio
async def test_decode_reads_every_page_from_the_cp_ranks_handles(cluster, model_dir):
    prompt = prompt_tokens(4 * PAGE + 3, seed=62)
    sampling = fc.params(8, temperature=0.8, top_k=20, seed=4)
    got = await fc.serve(
        fc.addr(cluster["prefill_cp2"]), fc.addr(cluster["decode_no_tier"]), "c3", prompt, sampling
    )
    assert got["ok"], got
    assert got["done"]["pulled"]["prefill_pages"] == 5  # pages 0-4 from two handles
    engine = load_engine(model_dir, dtype=DTYPE, page_size=PAGE)
    params = SamplingParams(8, temperature=0.8, top_k=20, seed=4)
    assert got["tokens"] == engine.generate([Request(prompt, params)])[0].tokens


def test_decode_refuses_cp(model_dir):
    done = subprocess.run(
        [sys.executable, "-m", "kvrelay.cli", "launch", "decode", "--model", str(model_dir),
         "--token", "t", "--cp", "2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0
    assert "--cp is not supported on decode" in done.stderr
