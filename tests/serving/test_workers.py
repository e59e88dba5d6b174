"""Prefill and decode workers as real processes, driven by a fake control:
the tokens equal one process's run, across TP/PP configs, with the tier
serving later turns and redeployed workers; failures return pages."""

from __future__ import annotations

import asyncio
import signal
import socket
import time

import pytest

from kvrelay.transfer import BlockHandle
from tests.serving import fake_control as fc
from tests.serving.conftest import PAGE, all_ready, cache_args, worker_args
from tests.serving.fake_control import addr, stats
from tests.support.models import prompt_tokens


@pytest.fixture(scope="module")
def cluster(launch, control, model_dir, page_bytes):
    """Two cache servers; prefill TP=1, TP=2 and PP=2 and decode TP=1 (with
    write-back) on the tier; decode TP=2 without it (all pages from prefill);
    a decode with 4 staging rows (it pulls the tier prefix through a window)."""
    caches = [launch(*cache_args(page_bytes), wait=False) for _ in range(2)]
    caches = [cache.info["listen"] for cache in caches]

    def worker(role, **kw):
        args = worker_args(role, model_dir, control, cache=kw.pop("cache", caches), **kw)
        return launch(*args, wait=False)

    workers = {
        "prefill": worker("prefill"),
        "prefill_tp2": worker("prefill", tp=2),
        "prefill_pp2": worker("prefill", pp=2),
        "decode": worker("decode", extra=["--write-back"]),
        "decode_tp2": worker("decode", tp=2, cache=()),
        "decode_rows4": worker("decode", extra=["--staging-pages", 4]),
    }
    all_ready(workers.values())
    return {"caches": caches, **workers}


def test_workers_register_with_control(cluster, control):
    roles = {}
    for name in ("prefill", "prefill_tp2", "decode"):
        info = cluster[name].info
        body = control.nodes[info["node_id"]]
        assert body["address"] == info["address"] and body["role"] == info["role"]
        roles[name] = body
    assert roles["prefill_tp2"]["tp"] == 2 and roles["prefill"]["tp"] == 1
    assert roles["prefill"]["namespace"] == roles["decode"]["namespace"]
    assert len(roles["prefill"]["namespace"]) == 64
    assert roles["decode"]["page_size"] == PAGE and roles["decode"]["vocab_size"] == 256
    deadline = time.monotonic() + 10
    while cluster["decode"].info["node_id"] not in control.heartbeats:
        assert time.monotonic() < deadline, "no heartbeat within 10 s"
        time.sleep(0.1)
    beat = control.heartbeats[cluster["decode"].info["node_id"]]
    assert beat["free_pages"] > 0 and "requests" in beat["stats"]
    # Control forgets a node (a restart): its next heartbeat registers it again.
    forgotten = cluster["prefill_pp2"].info["node_id"]
    with control.lock:
        del control.nodes[forgotten]
    while not any(
        body["address"] == addr(cluster["prefill_pp2"]) for body in control.nodes.values()
    ):
        assert time.monotonic() < deadline + 10, "no registration after a 404 heartbeat"
        time.sleep(0.1)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("sampling", "seed"),
    [(fc.params(12), 1), (fc.params(12, temperature=0.9, top_k=40, top_p=0.9, seed=3), 2)],
    ids=["greedy", "sampled"],
)
async def test_prefill_then_decode_equals_one_process(cluster, reference, sampling, seed):
    prompt = prompt_tokens(3 * PAGE + 5, seed=seed)
    got = await fc.serve(addr(cluster["prefill"]), addr(cluster["decode"]), "r1", prompt, sampling)
    assert got["ok"], got
    assert got["tokens"] == reference(prompt, sampling)
    answer = got["prefill"]
    # decode released prefill's handle: its staging rows are free again
    assert (await stats(cluster["prefill"]))["staging_free"] == 128
    assert answer["pages"] == 4 and answer["tier_pages"] == 3
    assert answer["spec"] == {"tp": 1, "pp": 1, "cp": 1} and len(answer["handles"]) == 1
    pulled = got["done"]["pulled"]
    # Three full pages sealed by prefill's write-through, the partial one from prefill.
    assert pulled == {"local_pages": 0, "tier_pages": 3, "prefill_pages": 1, "recomputed_pages": 0}


@pytest.mark.asyncio
async def test_decode_pulls_more_tier_pages_than_its_staging_rows(cluster, reference):
    # 9 pages, 8 of them in the tier (prefill's write-through): decode has 4
    # staging rows, so it takes the tier prefix a window at a time.
    prompt = prompt_tokens(8 * PAGE + 5, seed=21)
    sampling = fc.params(8)
    got = await fc.serve(addr(cluster["prefill"]), addr(cluster["decode_rows4"]), "w1", prompt,
                         sampling)  # fmt: skip
    assert got["ok"], got
    assert got["tokens"] == reference(prompt, sampling)
    assert got["done"]["pulled"] == {"local_pages": 0, "tier_pages": 8, "prefill_pages": 1,
                                     "recomputed_pages": 0}  # fmt: skip
    assert (await stats(cluster["decode_rows4"]))["staging_free"] == 4


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("prefill", "decode", "seed"),
    [("prefill_tp2", "decode", 10), ("prefill_pp2", "decode_tp2", 11)],
)
async def test_other_parallel_configs_give_the_same_tokens(
    cluster, reference, prefill, decode, seed
):
    prompt = prompt_tokens(2 * PAGE + 9, seed=seed)
    sampling = fc.params(10, temperature=0.7, seed=5)
    got = await fc.serve(addr(cluster[prefill]), addr(cluster[decode]), "r2", prompt, sampling)
    assert got["ok"], got
    assert got["tokens"] == reference(prompt, sampling)
    answer = got["prefill"]
    assert len(answer["handles"]) == 2  # two writer ranks, each its rectangle
    if decode == "decode_tp2":  # no tier: every page from the prefill handles
        assert got["done"]["pulled"]["prefill_pages"] == answer["pages"]


@pytest.mark.asyncio
async def test_second_turn_hits_the_tier_for_the_whole_conversation(cluster, reference):
    sampling = fc.params(20)
    turn1 = prompt_tokens(2 * PAGE + 3, seed=77)
    got = await fc.serve(addr(cluster["prefill"]), addr(cluster["decode"]), "t1", turn1, sampling)
    assert got["ok"], got
    conversation = turn1 + got["tokens"]
    # decode wrote back every full page of prompt + answer that has KV
    written = (len(conversation) - 1) // PAGE
    assert got["done"]["written_back_pages"] == written - 2  # prefill sealed the first 2
    turn2 = conversation + prompt_tokens(11, seed=78)
    # Another prefill worker (nothing in its pool): the tier holds the context.
    got2 = await fc.serve(addr(cluster["prefill_tp2"]), addr(cluster["decode"]), "t2", turn2,
                        sampling)  # fmt: skip
    assert got2["ok"], got2
    assert got2["prefill"]["cached_tokens"] == {"local": 0, "tier": written * PAGE}
    assert got2["tokens"] == reference(turn2, sampling)
    # decode holds the earlier pages in its own pool
    assert got2["done"]["pulled"]["local_pages"] >= written - 1


@pytest.mark.asyncio
async def test_a_redeployed_prefill_with_another_config_still_hits(cluster, reference):
    prompt = prompt_tokens(4 * PAGE + 2, seed=90)
    sampling = fc.params(6)
    # Nobody decodes this one: a short lease gives its staging rows back soon.
    first = await fc.prefill(addr(cluster["prefill"]), "d1", prompt, sampling, lease_s=1.0)
    assert first["ok"] and first["cached_tokens"]["tier"] == 0
    # Same model, PP=2 in its own process group: the tier serves the prompt.
    again = await fc.serve(addr(cluster["prefill_pp2"]), addr(cluster["decode"]), "d2", prompt,
                         sampling)  # fmt: skip
    assert again["ok"], again
    assert again["prefill"]["cached_tokens"] == {"local": 0, "tier": 4 * PAGE}
    assert again["tokens"] == reference(prompt, sampling)


@pytest.mark.asyncio
async def test_flush_drops_the_pool_cache(cluster):
    prompt = prompt_tokens(3 * PAGE + 4, seed=91)
    sampling = fc.params(3)
    decode = cluster["decode_tp2"]  # no tier: reuse comes only from its pool

    async def pulled() -> dict:
        got = await fc.serve(addr(cluster["prefill_pp2"]), addr(decode), "f", prompt, sampling)
        assert got["ok"], got
        return got["done"]["pulled"]

    assert (await pulled())["local_pages"] == 0
    # prefill's pool holds the 3 full pages (written through to the tier), so
    # it stages only the partial one; decode's pool has the others.
    assert (await pulled()) == {"local_pages": 3, "tier_pages": 0, "prefill_pages": 1,
                        "recomputed_pages": 0}  # fmt: skip
    assert (await fc.call(addr(decode), {"op": "flush"}))["op"] == "ok"
    # Now decode (no tier) cannot get the 3 pages prefill did not stage: it
    # recomputes the prompt instead of every prefill staging them.
    assert (await pulled()) == {"local_pages": 0, "tier_pages": 0, "prefill_pages": 0,
                        "recomputed_pages": 4}  # fmt: skip


@pytest.mark.asyncio
async def test_decode_recomputes_pages_it_cannot_get(cluster, reference):
    """Prefill stages only what the tier does not hold; a decode that cannot
    get the rest (its tier lost them, or it has none) computes them itself,
    with the same tokens."""
    prompt = prompt_tokens(3 * PAGE + 6, seed=95)
    sampling = fc.params(8)
    first = await fc.serve(
        addr(cluster["prefill"]), addr(cluster["decode"]), "l1", prompt, sampling
    )
    assert first["ok"], first
    answer = await fc.prefill(addr(cluster["prefill"]), "l2", prompt, sampling)
    assert answer["ok"] and answer["cached_tokens"]["local"] == 3 * PAGE
    assert answer["tier_pages"] == 3
    # decode_tp2 has no tier and none of these pages: the 3 unstaged pages are recomputed.
    got = await fc.decode(addr(cluster["decode_tp2"]), "l3", prompt, sampling, answer)
    assert got["ok"], got
    assert got["done"]["pulled"] == {"local_pages": 0, "tier_pages": 0, "prefill_pages": 0,
                                     "recomputed_pages": 4}  # fmt: skip
    assert got["tokens"] == reference(prompt, sampling)


@pytest.mark.asyncio
async def test_bad_requests_get_typed_errors(cluster):
    address = addr(cluster["prefill"])
    reply = await fc.call(address, {"op": "prefill", "rid": "x", "tokens": [1, 999],
                                  "params": fc.params(), "lease_s": 5})  # fmt: skip
    assert reply["error"] == "RequestError" and reply["rid"] == "x"
    reply = await fc.call(address, {"op": "prefill", "rid": "y", "tokens": [1, 2],
                                  "params": fc.params(max_new_tokens=0)})  # fmt: skip
    assert reply["error"] == "MalformedMessage"  # the params type bounds it
    assert "max_new_tokens" in reply["message"]
    reply = await fc.call(address, {"op": "prefill", "rid": "v", "tokens": [1, 2],
                                  "params": fc.params(stop=[999])})  # fmt: skip
    assert reply["error"] == "RequestError"  # outside this model's vocabulary
    reply = await fc.call(address, {"op": "decode"})  # no fields: refused by its type
    assert reply["error"] == "MalformedMessage"
    reply = await fc.call(address, {"op": "decode", "rid": "w", "tokens": [1], "first_token": 2,
                                  "pages": 1})  # fmt: skip
    assert reply["error"] == "RequestError" and reply["rid"] == "w"  # not a decode worker
    huge = prompt_tokens(129 * PAGE, seed=1)  # more pages than the pool has
    reply = await fc.prefill(address, "z", huge, fc.params())
    assert reply["error"] == "PoolExhausted"

    async def bad_token():
        conn = await fc.open_worker(address, token="wrong")
        conn.close()

    with pytest.raises(RuntimeError, match="AuthError"):
        await bad_token()


@pytest.mark.asyncio
async def test_prefill_abandoned_by_control_returns_its_staging_rows(cluster):
    prefill = cluster["prefill"]

    async def send_and_close(rid, length):
        conn = await fc.open_worker(addr(prefill))
        await conn.send({"op": "prefill", "rid": rid, "tokens": prompt_tokens(length, seed=7),
                         "params": fc.params(4), "lease_s": 300})  # fmt: skip
        conn.close()

    async def abandon():
        # Several at once: some are dropped while queued, some after computing.
        await asyncio.gather(*(send_and_close(f"a{i}", 5 * PAGE + i) for i in range(4)))
        async with asyncio.timeout(20):
            while (await stats(prefill))["staging_free"] != 128:
                await asyncio.sleep(0.1)

    await abandon()  # the 300 s leases ended at once, not by expiry


@pytest.mark.asyncio
@pytest.mark.parametrize("length", [1, 2 * PAGE], ids=["one-token", "whole-pages"])
async def test_prompts_without_full_or_partial_pages(cluster, reference, length):
    prompt = prompt_tokens(length, seed=60 + length)
    sampling = fc.params(7)
    got = await fc.serve(addr(cluster["prefill_tp2"]), addr(cluster["decode"]), "e", prompt,
                       sampling)  # fmt: skip
    assert got["ok"], got
    assert got["tokens"] == reference(prompt, sampling)
    assert got["prefill"]["pages"] == -(-length // PAGE)


@pytest.mark.asyncio
async def test_a_first_token_that_stops_needs_no_decode(cluster, reference):
    prompt = prompt_tokens(PAGE + 3, seed=61)
    first = reference(prompt, fc.params(1))[0]
    answer = await fc.prefill(addr(cluster["prefill"]), "s", prompt, fc.params(5, stop=[first]))
    assert answer["ok"] and answer["first_token"] == first
    assert answer["finish_reason"] == "stop" and answer["handles"] == []
    assert (await stats(cluster["prefill"]))["staging_free"] == 128


@pytest.mark.asyncio
async def test_cancelled_decode_returns_its_pages(cluster):
    decode = cluster["decode"]
    start = (await stats(decode))["free_pages"]
    prompt = prompt_tokens(PAGE + 4, seed=123)
    sampling = fc.params(300)
    answer = await fc.prefill(addr(cluster["prefill"]), "c1", prompt, sampling)

    async def read_then_close():
        conn = await fc.open_worker(addr(decode))
        await conn.send({"op": "decode", "rid": "c1", "tokens": prompt, "params": sampling,
                         "first_token": answer["first_token"], "tier_pages": answer["tier_pages"],
                         "pages": answer["pages"], "handles": answer["handles"]})  # fmt: skip
        frame = await conn.recv()
        assert frame["ok"] and frame["tokens"]
        during = (await stats(decode))["free_pages"]
        conn.close()
        return during

    during = await read_then_close()
    assert during < start
    deadline = time.monotonic() + 15
    while (await stats(decode))["free_pages"] != start:
        assert time.monotonic() < deadline, "the cancelled sequence kept its pages"
        await asyncio.sleep(0.1)


@pytest.mark.asyncio
async def test_killed_prefill_fails_fast_and_decode_returns_pages(
    cluster, launch, control, model_dir
):
    victim = launch(*worker_args("prefill", model_dir, control, cache=()))
    decode = cluster["decode_tp2"]  # no tier: every page comes from prefill
    start = (await stats(decode))["free_pages"]
    prompt = prompt_tokens(3 * PAGE + 1, seed=55)
    sampling = fc.params(8)
    answer = await fc.prefill(addr(victim), "k1", prompt, sampling)
    assert answer["ok"]

    async def kill_mid_request():
        conn = await fc.open_worker(addr(victim))
        await conn.send({"op": "prefill", "rid": "k2", "tokens": prompt_tokens(100, seed=3),
                         "params": sampling, "lease_s": 5})  # fmt: skip
        victim.process.send_signal(signal.SIGKILL)
        began = time.monotonic()
        with pytest.raises(Exception) as caught:
            async with asyncio.timeout(10):
                await conn.recv()
        conn.close()
        return caught.value, time.monotonic() - began

    error, waited = await kill_mid_request()
    assert not isinstance(error, TimeoutError) and waited < 10
    victim.process.wait(10)
    # decode asked to pull from the dead worker: a typed error, pages back
    began = time.monotonic()
    failed = await fc.decode(addr(decode), "k1", prompt, sampling, answer)
    assert not failed["ok"] and failed["error"] == "PullFailed"
    assert time.monotonic() - began < 15
    assert (await stats(decode))["free_pages"] == start


@pytest.mark.asyncio
async def test_a_stalled_pull_does_not_stall_the_running_batch(cluster, control):
    """A prefill agent that accepts connections and never answers: decode's
    pull waits for its deadline (5 s) while the running sequence streams."""
    decode = cluster["decode_tp2"]  # no tier: every page comes from the handles
    start = (await stats(decode))["free_pages"]
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel completes connections nobody serves
    namespace = bytes.fromhex(control.nodes[decode.info["node_id"]]["namespace"])
    prompt = prompt_tokens(2 * PAGE + 3, seed=57)
    page_bytes = 2 * PAGE * 2 * 16 * 2 * 8  # 2 heads x 2 layers x K+V of head dim 16, float64
    runs = [[0, page_bytes]]
    fake = BlockHandle(
        backend="tcp", agent=f"127.0.0.1:{silent.getsockname()[1]}", agent_id=b"x" * 16,
        arena_id=1, rkey=b"", base=0, runs=tuple((i * page_bytes, page_bytes) for i in range(3)),
        lease_id=1, lease_expiry=time.time() + 60, namespace=namespace,
    )  # fmt: skip
    stalled_answer = {"first_token": 1, "tier_pages": 0, "pages": 3,
                      "handles": [{"handle": fake.to_bytes(), "runs": runs}]}  # fmt: skip
    healthy_prompt = prompt_tokens(PAGE + 5, seed=56)
    long_run = fc.params(400)
    healthy = await fc.prefill(addr(cluster["prefill_pp2"]), "h", healthy_prompt, long_run)

    async def stalled_pull_beside_a_running_sequence():
        conn = await fc.open_worker(addr(decode))
        await conn.send({"op": "decode", "rid": "h", "tokens": healthy_prompt,
                         "params": long_run, "first_token": healthy["first_token"],
                         "tier_pages": 0, "pages": healthy["pages"],
                         "handles": healthy["handles"]})  # fmt: skip
        assert (await conn.recv())["ok"]
        frames = []

        async def collect():
            while not (await conn.recv()).get("done"):
                frames.append(time.monotonic())

        collector = asyncio.create_task(collect())
        began = time.monotonic()
        stalled = await fc.decode(addr(decode), "s0", prompt, fc.params(8), stalled_answer)
        ended = time.monotonic()
        await collector
        conn.close()
        return stalled, sum(began <= t <= ended for t in frames), ended - began

    try:
        stalled, during, waited = await stalled_pull_beside_a_running_sequence()
    finally:
        silent.close()
    assert not stalled["ok"] and stalled["error"] == "PullFailed"
    assert "TransferTimeout" in stalled["message"] and 4 < waited < 15
    assert during >= 20  # tokens streamed while the pull waited
    assert (await stats(decode))["free_pages"] == start
