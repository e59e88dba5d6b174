"""Cache-aware choice, load tiebreak, Busy, retries, timeouts and cancellation."""

import concurrent.futures
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvrelay.control.dispatch import rank
from kvrelay.control.registry import Registry
from tests.control.conftest import wait_until
from tests.control.fakes import expected_answer
from tests.control.sse import parse_sse


def complete(control, prompt, max_tokens=4, **extra):
    reply = control.http.post(
        "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens} | extra
    )
    return reply


def stats(control):
    return control.http.get("/stats").json()


def set_queued(control, worker, queued):
    worker.queued = queued
    wait_until(lambda: control.registry.nodes[worker.node_id].queued == queued,
               what="heartbeat with the new queue depth")  # fmt: skip


def test_rank_prefers_score_then_load_within_one_page():
    registry = Registry(1.0)
    nodes = [
        registry.register(role="prefill", address=f"127.0.0.1:{port}", model="m",
                          namespace=b"\0" * 32, page_size=4, vocab_size=10, tp=1, pp=1,
                          num_pages=8, cache=False)
        for port in (1, 2, 3, 4)
    ]  # fmt: skip
    a, b, c, d = nodes
    a.queued, b.queued, c.queued, d.queued = 9, 1, 0, 0
    scores = {a.node_id: 5, b.node_id: 4, c.node_id: 2, d.node_id: 3}
    # a and b are within one page of the best (5): the less loaded b first;
    # then the others by score.
    assert [n.node_id for n in rank(nodes, scores)] == [b.node_id, a.node_id, d.node_id,
                                                        c.node_id]  # fmt: skip
    scores[b.node_id] = 3
    assert rank(nodes, scores)[0] is a


def test_prefix_affinity_beats_load_and_load_breaks_ties(cluster):
    control = cluster.control()
    first, second = cluster.worker("prefill"), cluster.worker("prefill")
    cluster.worker("decode")
    shared = list(range(100, 116))  # four pages of 4 tokens
    one = complete(control, shared).json()["kvrelay"]["prefill_node"]
    holder = first if one == first.node_id else second
    other = second if holder is first else first
    set_queued(control, holder, 5)
    # The same prefix goes back to the worker that holds it, busier or not ...
    again = complete(control, [*shared, 1, 2]).json()
    assert again["kvrelay"]["prefill_node"] == holder.node_id
    assert again["kvrelay"]["cached_tokens"] == {"local": 16, "tier": 0}
    # ... and an unrelated prompt to the least loaded.
    fresh = complete(control, list(range(200, 216))).json()
    assert fresh["kvrelay"]["prefill_node"] == other.node_id
    assert stats(control)["tokens"]["local"] == 16


def test_conversation_returns_to_its_decode_worker(cluster):
    control = cluster.control()
    cluster.worker("prefill")
    decodes = [cluster.worker("decode"), cluster.worker("decode")]
    turn1 = list(range(10, 18))
    body = complete(control, turn1, max_tokens=8).json()
    holder = next(d for d in decodes if d.node_id == body["kvrelay"]["decode_node"])
    other = decodes[1] if holder is decodes[0] else decodes[0]
    set_queued(control, holder, 3)
    turn2 = turn1 + body["choices"][0]["token_ids"] + [40, 41, 42, 43]
    assert complete(control, turn2).json()["kvrelay"]["decode_node"] == holder.node_id
    assert complete(control, [70, 71]).json()["kvrelay"]["decode_node"] == other.node_id


def test_busy_worker_passes_the_request_on(cluster):
    control = cluster.control()
    busy, free = cluster.worker("prefill"), cluster.worker("prefill")
    cluster.worker("decode")
    busy.mode = "busy"
    body = complete(control, "abc").json()
    assert body["kvrelay"]["prefill_node"] == free.node_id
    assert len(busy.requests) == 1
    counters = stats(control)
    assert (counters["busy"], counters["retries"]) == (1, 0)
    assert control.registry.nodes[busy.node_id].state == "live"


def test_all_busy_waits_for_a_free_worker(cluster):
    control = cluster.control()
    busy = cluster.worker("prefill")
    cluster.worker("decode")
    busy.mode = "busy"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(complete, control, "abc")
        # It waits (no 503 at once) ...
        wait_until(lambda: stats(control)["busy_waits"] >= 1, what="a wait for capacity")
        assert not pending.done()
        busy.mode = "ok"  # ... and the worker's next heartbeat wakes it.
        reply = pending.result(30)
    assert reply.status_code == 200, reply.text
    assert reply.json()["kvrelay"]["prefill_node"] == busy.node_id
    assert control.registry.nodes[busy.node_id].state == "live"


def test_all_busy_until_the_deadline_is_503_with_reason(cluster):
    control = cluster.control(request_timeout_s=2.0)
    busy = cluster.worker("prefill")
    cluster.worker("decode")
    busy.mode = "busy"
    reply = complete(control, "abc")
    assert reply.status_code == 503
    assert "stayed busy until the request's deadline (2 s)" in reply.json()["error"]["message"]
    assert len(busy.requests) >= 2  # asked again after a heartbeat, not failed at once
    assert control.registry.nodes[busy.node_id].state == "live"  # waiting blames no one


def test_killed_prefill_is_retried_on_another(cluster):
    control = cluster.control()
    dying, spare = cluster.worker("prefill"), cluster.worker("prefill")
    cluster.worker("decode")
    dying.mode = "die"  # closes its listener and the connection mid-request
    body = complete(control, "retry me", max_tokens=3).json()
    assert body["kvrelay"]["prefill_node"] == spare.node_id
    assert body["choices"][0]["token_ids"] == expected_answer(list(b"retry me"), 3, 512)
    assert len(dying.requests) == 1
    assert stats(control)["retries"] == 1
    # Out of rotation at once; gone for good after its missed heartbeats.
    assert control.registry.nodes[dying.node_id].state == "suspect"
    wait_until(lambda: dying.node_id not in control.registry.nodes, what="expiry")
    assert complete(control, "next").json()["kvrelay"]["prefill_node"] == spare.node_id


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_malformed_replies_are_worker_faults(cluster, role):
    control = cluster.control()
    pairs = {r: [cluster.worker(r)] for r in ("prefill", "decode")}
    pairs[role].append(cluster.worker(role))
    bad, good = pairs[role]
    bad.mode = "garbage"
    body = complete(control, "odd", max_tokens=4).json()
    assert body["kvrelay"][f"{role}_node"] == good.node_id
    assert body["choices"][0]["token_ids"] == expected_answer(list(b"odd"), 4, 512)
    assert stats(control)["retries"] == 1


def test_refused_connection_removes_the_node(cluster):
    control = cluster.control()
    gone = cluster.worker("prefill")
    cluster.worker("decode")
    cluster.loop.run(gone.die())
    reply = complete(control, "x")
    assert reply.status_code == 503
    message = reply.json()["error"]["message"]
    assert message.startswith("no prefill worker available for fake (last: ")
    assert gone.node_id not in control.registry.nodes
    assert stats(control)["removed_nodes"]["refused"] == 1


def test_clear_error_when_no_worker_is_left(cluster):
    control = cluster.control(heartbeat_s=3.0)  # none expires during the test
    workers = [cluster.worker("prefill") for _ in range(3)]
    cluster.worker("decode")
    for worker in workers:
        worker.mode = "fault"
        worker.heartbeating = False  # no heartbeat brings one back during the test
    started = time.monotonic()
    reply = complete(control, "doomed")
    assert time.monotonic() - started < 5
    assert reply.status_code == 502
    assert reply.json()["error"]["message"].startswith("prefill failed 3 times, last: ")
    assert [len(w.requests) for w in workers] == [1, 1, 1]
    assert all(control.registry.nodes[w.node_id].state == "suspect" for w in workers)
    # The next request finds nobody in rotation and says so at once.
    again = complete(control, "doomed")
    assert again.status_code == 503
    assert stats(control)["errors"] == 2


def test_slow_worker_hits_the_request_timeout_and_is_cancelled(cluster):
    control = cluster.control(request_timeout_s=1.5, heartbeat_s=3.0)  # no expiry meanwhile
    slow = cluster.worker("prefill")
    cluster.worker("decode")
    slow.mode, slow.delay = "slow", 30.0
    slow.heartbeating = False  # (a heartbeat would bring it back from suspect)
    started = time.monotonic()
    reply = complete(control, "slow")
    elapsed = time.monotonic() - started
    assert reply.status_code == 504, reply.text
    assert reply.json()["error"]["message"] == "request timed out after 1.5 s"
    assert 1.4 < elapsed < 6
    assert control.registry.nodes[slow.node_id].state == "suspect"
    rid = slow.requests[0]["rid"]
    wait_until(lambda: rid in slow.cancelled, what="the worker connection to close")


def test_hung_worker_is_a_fault_after_the_connect_timeout(cluster):
    control = cluster.control(connect_timeout_s=0.5)
    hung, spare = cluster.worker("prefill"), cluster.worker("prefill")
    cluster.worker("decode")
    hung.mode = "mute"
    body = complete(control, "hung").json()
    assert body["kvrelay"]["prefill_node"] == spare.node_id
    assert control.registry.nodes[hung.node_id].state == "suspect"
    wait_until(lambda: hung.cancelled == ["hello"], what="the hung connection to close")


def test_no_decode_worker_fails_before_prefill(cluster):
    control = cluster.control()
    prefill = cluster.worker("prefill")
    reply = complete(control, "x")
    assert reply.status_code == 503
    assert reply.json()["error"]["message"] == "no decode worker available for fake"
    assert prefill.requests == []
    # A one-token answer needs no decode.
    assert complete(control, "x", max_tokens=1).json()["choices"][0]["token_ids"] == [ord("y")]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_worker_slower_than_the_attempt_timeout_is_passed_over(cluster, role):
    control = cluster.control(attempt_timeout_s=0.5)
    pairs = {r: [cluster.worker(r)] for r in ("prefill", "decode")}
    pairs[role].append(cluster.worker(role))
    slow, good = pairs[role]
    slow.mode, slow.delay = "slow", 30.0
    started = time.monotonic()
    body = complete(control, "late", max_tokens=4).json()
    assert time.monotonic() - started < 5
    assert body["kvrelay"][f"{role}_node"] == good.node_id
    assert body["choices"][0]["token_ids"] == expected_answer(list(b"late"), 4, 512)
    assert stats(control)["retries"] == 1
    rid = slow.requests[0]["rid"]
    wait_until(lambda: rid in slow.cancelled, what="the slow worker's connection to close")


def test_decode_failure_before_tokens_retries_with_the_same_handles(cluster):
    control = cluster.control()
    prefill = cluster.worker("prefill")
    bad, good = cluster.worker("decode"), cluster.worker("decode")
    bad.mode = "fault"
    body = complete(control, "handles", max_tokens=6).json()
    assert body["kvrelay"]["decode_node"] == good.node_id
    assert body["choices"][0]["token_ids"] == expected_answer(list(b"handles"), 6, 512)
    assert len(prefill.requests) == 1
    assert good.requests[0]["handles"] == bad.requests[0]["handles"]
    assert stats(control)["retries"] == 1


def test_decode_failure_after_the_lease_goes_back_to_prefill(cluster):
    control = cluster.control(lease_s=0.4)
    prefill = cluster.worker("prefill")
    late, good = cluster.worker("decode"), cluster.worker("decode")
    late.mode, late.delay = "late_fault", 0.8
    prompt = [50, 51, 52]
    body = complete(control, prompt, max_tokens=6).json()
    assert body["choices"][0]["token_ids"] == expected_answer(prompt, 6, 512)
    assert body["kvrelay"]["decode_node"] == good.node_id
    # Prefill ran again on the prompt plus the token the client already has.
    assert [r["tokens"] for r in prefill.requests] == [prompt, [*prompt, 53]]
    assert prefill.requests[1]["params"]["max_new_tokens"] == 5
    assert good.requests[0]["first_token"] == 54


def test_handles_that_cannot_be_pulled_go_back_to_prefill(cluster):
    """Decode answers PullFailed (the prefill that published the handles
    died): no decode can pull them and this one is not at fault, so control
    prefills again and the decode stays in rotation. (`kvrelay bench chaos`
    found both decodes suspected in turn and requests ending with 503.)"""
    control = cluster.control()
    prefill = cluster.worker("prefill")
    decode = cluster.worker("decode")
    decode.mode = "pull_failed_once"
    prompt = [90, 91, 92]
    body = complete(control, prompt, max_tokens=6).json()
    answer = expected_answer(prompt, 6, 512)
    assert body["choices"][0]["token_ids"] == answer
    # Prefill again on the prompt plus the first token the client already has.
    assert [r["tokens"] for r in prefill.requests] == [prompt, [*prompt, answer[0]]]
    assert len(decode.requests) == 2
    assert control.registry.nodes[decode.node_id].state == "live"
    assert stats(control)["retries"] == 1


def test_decode_failure_after_tokens_resumes_on_another_decode(cluster):
    control = cluster.control()
    prefill = cluster.worker("prefill")
    dropping, good = cluster.worker("decode"), cluster.worker("decode")
    dropping.mode = "drop_after"  # one batch of 2 tokens, then the connection closes
    prompt = [70, 71, 72]
    body = complete(control, prompt, max_tokens=8).json()
    answer = expected_answer(prompt, 8, 512)
    assert body["choices"][0]["token_ids"] == answer
    assert [len(r["tokens"]) for r in dropping.requests] == [3]
    assert body["kvrelay"]["decode_node"] == good.node_id
    # Prefill again on the prompt plus the first token and the dropped decode's two.
    assert [r["tokens"] for r in prefill.requests] == [prompt, prompt + answer[:3]]
    assert prefill.requests[1]["params"]["max_new_tokens"] == 5
    assert good.requests[0]["first_token"] == answer[3]
    assert (stats(control)["retries"], stats(control)["resumed"]) == (1, 1)
    assert "kvrelay_resumed_total 1.0" in control.http.get("/metrics").text


def test_decode_failure_after_tokens_with_no_other_decode_ends_with_an_error(cluster):
    control = cluster.control()
    cluster.worker("prefill")
    decode = cluster.worker("decode")
    decode.mode = "drop_after"
    reply = complete(control, "cut", max_tokens=10)
    assert reply.status_code == 502
    assert "failed after 2 tokens" in reply.json()["error"]["message"]
    # Suspect until its next heartbeat proves it alive.
    wait_until(lambda: control.registry.nodes[decode.node_id].state == "live", what="heartbeat")
    with control.http.stream(
        "POST", "/v1/completions", json={"prompt": "cut", "max_tokens": 10, "stream": True}
    ) as stream:
        events = parse_sse(stream.read().decode())
    assert [name for name, _ in events] == ["message", "message", "error"]
    assert "failed after 2 tokens" in events[-1][1]["error"]["message"]
    assert stats(control)["retries"] == 0


@pytest.mark.parametrize(("mode", "status"), [("request_error", 400), ("pool_exhausted", 400)])
def test_worker_rejections_are_client_errors(cluster, mode, status):
    control = cluster.control()
    workers = [cluster.worker("prefill"), cluster.worker("prefill")]
    cluster.worker("decode")
    for worker in workers:
        worker.mode = mode
    reply = complete(control, "no")
    assert reply.status_code == status
    assert f"fake {mode}" in reply.json()["error"]["message"]
    # PoolExhausted tries the other worker (its pool may be bigger); RequestError does not.
    assert sum(len(w.requests) for w in workers) == (2 if mode == "pool_exhausted" else 1)


def test_client_going_away_closes_the_worker_connection(cluster):
    control = cluster.control()
    prefill = cluster.worker("prefill")
    decode = cluster.worker("decode")
    decode.mode, decode.delay = "slow", 0.3
    with control.http.stream(
        "POST", "/v1/completions", json={"prompt": "bye", "max_tokens": 60, "stream": True}
    ) as stream:
        data = (line for line in stream.iter_lines() if line.startswith("data: "))
        next(data)  # the first token, from prefill
        next(data)  # a decode batch: decode is under way
    rid = decode.requests[0]["rid"]
    wait_until(lambda: rid in decode.cancelled, what="decode to see the connection close")
    # A non-streaming client that times out is noticed too.
    prefill.mode, prefill.delay = "slow", 30.0
    with pytest.raises(httpx.ReadTimeout):
        control.http.post("/v1/completions", json={"prompt": "bye"}, timeout=1.0)
    rid = prefill.requests[-1]["rid"]
    wait_until(lambda: rid in prefill.cancelled, what="prefill to see the connection close")
    wait_until(lambda: stats(control)["cancelled"] >= 1, what="the cancel to be counted")


def test_concurrent_requests_spread_by_in_flight_load(cluster):
    control = cluster.control()
    prefills = [cluster.worker("prefill"), cluster.worker("prefill")]
    cluster.worker("decode")
    for worker in prefills:
        worker.mode, worker.delay = "slow", 1.0
    prompts = [[i, i + 1, i + 2] for i in range(0, 60, 10)]

    def one(prompt):
        return complete(control, prompt, max_tokens=3).json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(one, prompts))
    assert answers == [expected_answer(p, 3, 512) for p in prompts]
    # Control counts its own open requests, so the second worker is used
    # before heartbeats could report any queue.
    assert min(len(w.requests) for w in prefills) >= 2
    assert all(n.inflight == 0 for n in control.registry.nodes.values())


def test_job_keys_of_the_prompt_and_what_follows_extend_the_prompt_chain():
    from types import SimpleNamespace

    from kvrelay.control.dispatch import Job
    from kvrelay.layout.keys import page_keys

    node = SimpleNamespace(namespace=b"n" * 32, page_size=4, key_scheme="kvrelay")
    prompt = list(range(10))
    job = Job("r", "m", prompt, {})
    assert job.page_keys(node) == page_keys(node.namespace, prompt, 4)
    for longer in (prompt, [*prompt, 7], [*prompt, 7, 8, 9, 1, 2, 3], [1, *prompt[1:], 5]):
        assert job.page_keys(node, longer) == page_keys(node.namespace, longer, 4)
