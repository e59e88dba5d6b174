"""Registry liveness, drain, /stats and /metrics, flush through a real cache
server, and the `kvrelay launch control` process."""

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from kvrelay.cli import build_parser
from kvrelay.control.launch import bind, config_from_args
from kvrelay.control.stats import TTFT_PHASES, request_class, ttft_phases
from kvrelay.layout import ParallelConfig
from kvrelay.layout.ring import HashRing
from tests.cache.server_process import TOKEN as CACHE_TOKEN
from tests.cache.server_process import ServerProcess
from tests.cache.specs import SPEC
from tests.cache.test_server import KEYS, write_pages
from tests.control.conftest import AUTH, wait_until


def test_missed_heartbeats_take_a_node_out_and_it_registers_again(cluster):
    control = cluster.control(heartbeat_s=0.3)
    worker = cluster.worker("prefill")
    first_id = worker.node_id
    worker.heartbeating = False
    started = time.monotonic()
    wait_until(lambda: first_id not in control.registry.nodes, what="expiry")
    assert time.monotonic() - started >= 0.3 * 2  # not before the misses
    assert control.http.get("/stats").json()["removed_nodes"]["expired"] == 1
    late = control.http.post(f"/v1/nodes/{first_id}/heartbeat", json={}, headers=AUTH)
    assert late.status_code == 404 and "register again" in late.json()["detail"]
    worker.heartbeating = True  # its next heartbeat gets 404: it registers again
    wait_until(lambda: worker.registrations == 2, what="re-registration")
    assert worker.node_id != first_id and worker.node_id in control.registry.nodes


def test_deregistration(cluster):
    control = cluster.control()
    worker = cluster.worker("decode")
    assert control.http.delete(f"/v1/nodes/{worker.node_id}", headers=AUTH).status_code == 200
    assert control.registry.nodes == {}
    assert control.http.delete(f"/v1/nodes/{worker.node_id}", headers=AUTH).status_code == 404


def test_drain_reaches_the_worker_and_takes_it_out_of_rotation(cluster):
    control = cluster.control()
    draining, other = cluster.worker("prefill"), cluster.worker("prefill")
    cluster.worker("decode")
    reply = control.http.post("/admin/drain", json={"node_id": draining.node_id}, headers=AUTH)
    assert reply.json() == {"node_id": draining.node_id, "state": "draining", "acknowledged": True}
    assert draining.ops == ["drain"]
    beats = draining.heartbeats  # a heartbeat does not bring a draining node back
    wait_until(lambda: draining.heartbeats > beats, what="a heartbeat of the draining node")
    for _ in range(3):
        body = control.http.post("/v1/completions", json={"prompt": "d"}).json()
        assert body["kvrelay"]["prefill_node"] == other.node_id
    assert draining.requests == []
    unknown = control.http.post("/admin/drain", json={"node_id": "nope"}, headers=AUTH)
    assert unknown.status_code == 404


def test_stats_and_metrics(cluster):
    control = cluster.control()
    prefill = cluster.worker("prefill")
    decode = cluster.worker("decode")
    prompt = list(range(1, 9))  # two pages
    for _ in range(3):
        assert control.http.post(
            "/v1/completions", json={"prompt": prompt, "max_tokens": 5}
        ).status_code == 200  # fmt: skip
    control.http.post("/v1/completions", json={"prompt": "", "max_tokens": 5})
    prefill.counters["bytes_to_tier"] = 4096
    decode.counters["bytes_from_prefill"] = 1000
    prefill.queued = 2
    wait_until(lambda: control.registry.nodes[prefill.node_id].queued == 2, what="heartbeat")
    wait_until(
        lambda: control.http.get("/stats").json()["bytes_moved"]["bytes_from_prefill"] == 1000,
        what="decode heartbeat",
    )
    stats = control.http.get("/stats").json()
    assert (stats["requests"], stats["completed"], stats["errors"]) == (4, 3, 1)
    assert stats["client_errors"] == 1
    # The fake prefill hits its own pages on the 2nd and 3rd request: 16 of 24 tokens.
    assert stats["tokens"] | {"probed_tier": 0} == {
        "prompt": 24, "local": 16, "tier": 0, "computed": 8, "completion": 15, "probed_tier": 0
    }  # fmt: skip
    assert stats["hit_rates"] == {"local": 16 / 24, "tier": 0.0, "computed": 8 / 24}
    assert stats["ttft_s"]["count"] == 3
    assert 0 < stats["ttft_s"]["p50"] <= stats["ttft_s"]["p90"] <= stats["ttft_s"]["p99"]
    assert stats["inter_token_s"]["count"] == 12  # 4 decode tokens per request
    # TTFT by phase, per request class (8-token prompts: the smallest class).
    phases = stats["ttft_phases_s"]
    assert list(phases) == ["<8K"]
    assert list(phases["<8K"]) == [*TTFT_PHASES, "decode_pull"]
    assert all(p["count"] == 3 for p in phases["<8K"].values())
    # The fake's phases are 0: control's share is the whole TTFT.
    assert phases["<8K"]["control"]["p50"] == stats["ttft_s"]["p50"]
    assert stats["bytes_moved"] == {
        "bytes_from_tier": 0, "bytes_to_tier": 4096, "bytes_from_prefill": 1000
    }  # fmt: skip
    assert stats["queues"][prefill.node_id] == {
        "role": "prefill", "queued": 2, "active": 0, "inflight": 0
    }  # fmt: skip
    text = control.http.get("/metrics")
    assert text.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = {}
    for line in text.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    assert samples["kvrelay_requests_total"] == 4
    assert samples['kvrelay_request_errors_total{kind="client"}'] == 1
    assert samples['kvrelay_prompt_tokens_total{source="local"}'] == 16
    assert samples['kvrelay_prompt_tokens_total{source="computed"}'] == 8
    assert samples["kvrelay_ttft_seconds_count"] == 3
    assert samples['kvrelay_ttft_seconds_bucket{le="+Inf"}'] == 3
    assert samples["kvrelay_ttft_seconds_sum"] == pytest.approx(
        sum(control.app.state.stats.ttft_s)
    )  # fmt: skip
    assert samples["kvrelay_inter_token_seconds_count"] == 12
    assert samples['kvrelay_prefill_phase_seconds_count{phase="lookup"}'] == 3
    assert samples["kvrelay_kv_transfer_seconds_count"] == 3  # one per decode
    phase = 'kvrelay_ttft_phase_seconds_count{phase="%s",request_class="<8K"}'
    assert samples[phase % "compute"] == samples[phase % "decode_pull"] == 3
    assert samples['kvrelay_worker_events_total{counter="bytes_to_tier"}'] == 4096
    assert samples[f'kvrelay_node_queue_depth{{node="{prefill.node_id}",role="prefill"}}'] == 2
    assert samples['kvrelay_nodes{role="decode",state="live"}'] == 1
    assert "# TYPE kvrelay_ttft_seconds histogram" in text.text
    # Each app has its own registry: a second control starts from zero.
    other = cluster.control()
    assert "kvrelay_requests_total 0.0" in other.http.get("/metrics").text


@pytest.mark.asyncio
async def test_tier_probe_and_flush_through_real_cache_servers(cluster):
    servers = [ServerProcess(), ServerProcess()]
    addresses = sorted(s.address for s in servers)
    pages = 6
    try:
        assert await write_pages(addresses, ParallelConfig(tp=1), range(pages)) == pages
        # One cluster token opens control, the workers and the cache servers.
        control = cluster.control(cache=tuple(addresses), token=CACHE_TOKEN)
        auth = {"Authorization": f"Bearer {CACHE_TOKEN}"}
        spec_kw = {"namespace": SPEC.namespace(), "page_size": SPEC.page_size,
                   "token": CACHE_TOKEN}  # fmt: skip
        prefill = cluster.worker("prefill", **spec_kw)
        decode = cluster.worker("decode", **spec_kw)
        prompt = list(range(SPEC.page_size * pages + 2))  # the written pages, then more

        def probed_pages() -> int:
            body = control.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
            assert body.status_code == 200, body.text
            return control.http.get("/stats").json()["tokens"]["probed_tier"] // SPEC.page_size

        assert probed_pages() == pages
        stats = control.http.get("/stats").json()
        assert stats["tier"] == {"servers": addresses, "probes": 1, "errors": 0}
        other = control.http.post("/admin/flush", json={"namespace": "00" * 32}, headers=auth)
        assert other.json() == {"tier": dict.fromkeys(addresses, 0), "workers": {}}
        flushed = control.http.post(
            "/admin/flush", json={"namespace": SPEC.namespace().hex()}, headers=auth
        ).json()
        ring = HashRing(addresses)
        per_server = [sum(ring.server_for(k) == a for k in KEYS[:pages]) for a in addresses]
        assert flushed == {
            "tier": dict(zip(addresses, per_server, strict=True)),
            "workers": {prefill.node_id: True, decode.node_id: True},
        }
        assert prefill.ops == ["flush"] and decode.ops == ["flush"]
        assert probed_pages() == pages  # nothing more found after the flush
        # Pages back, then one server dies: the hit ends at its first key.
        assert await write_pages(addresses, ParallelConfig(tp=1), range(pages)) == pages
        dead = next(s for s in servers if s.address == ring.server_for(KEYS[2]))
        dead.stop(signal.SIGKILL)
        expected = next(i for i, k in enumerate(KEYS) if ring.server_for(k) == dead.address)
        assert 0 <= expected <= 2
        assert probed_pages() == pages + expected
        assert control.http.get("/stats").json()["tier"]["errors"] >= 1
    finally:
        for server in servers:
            server.stop()


def test_a_dead_cache_server_counts_as_misses(cluster):
    control = cluster.control(cache=("127.0.0.1:9",))
    cluster.worker("prefill")
    cluster.worker("decode")
    body = control.http.post("/v1/completions", json={"prompt": "long enough", "max_tokens": 2})
    assert body.status_code == 200
    assert control.http.get("/stats").json()["tier"]["errors"] == 1
    flushed = control.http.post("/admin/flush", json={}, headers=AUTH).json()
    assert flushed["tier"] == {"127.0.0.1:9": None}


def test_launch_control_process():
    env = dict(os.environ, KVRELAY_TOKEN="cli-token")
    process = subprocess.Popen(
        [sys.executable, "-m", "kvrelay.cli", "launch", "control", "--listen", "127.0.0.1:0",
         "--heartbeat-s", "0.5"],
        stdout=subprocess.PIPE, env=env,
    )  # fmt: skip
    try:
        ready, _, _ = select.select([process.stdout], [], [], 60)
        assert ready, "control did not start within 60 s"
        listen = json.loads(process.stdout.readline())["listen"]
        url = f"http://{listen}"
        assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"
        wrong = httpx.post(f"{url}/admin/flush", json={}, timeout=10,
                           headers={"Authorization": "Bearer other"})  # fmt: skip
        assert wrong.status_code == 403
        ok = httpx.post(f"{url}/admin/flush", json={}, timeout=10,
                        headers={"Authorization": "Bearer cli-token"})  # fmt: skip
        assert ok.json() == {"tier": {}, "workers": {}}
        process.send_signal(signal.SIGTERM)
        assert process.wait(15) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(5)
        process.stdout.close()


@pytest.mark.parametrize(
    ("args", "message"),
    [([], "give --token or set KVRELAY_TOKEN"),
     (["--token", "t", "--heartbeat-s", "0"], "--heartbeat-s must be > 0"),
     (["--token", "t", "--max-retries", "-1"], "--max-retries must be >= 0")],
)  # fmt: skip
def test_launch_control_rejects_bad_flags(monkeypatch, args, message):
    monkeypatch.delenv("KVRELAY_TOKEN", raising=False)
    parsed = build_parser().parse_args(["launch", "control", *args])
    with pytest.raises(SystemExit, match=message):
        config_from_args(parsed)
    good = build_parser().parse_args(["launch", "control", "--token", "t", "--cache", "a:1, b:2"])
    assert config_from_args(good).cache == ("a:1", "b:2")


def test_launch_control_refuses_a_taken_address():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit, match=f"cannot listen on 127.0.0.1:{port}"):
            bind(f"127.0.0.1:{port}")
    with pytest.raises(SystemExit, match="--listen must be HOST:PORT"):
        bind("8000")


def test_request_classes_and_ttft_phases():
    assert [request_class(n) for n in (1, 8191, 8192, 200_000, 524_288, 1 << 20)] == [
        "<8K", "<8K", "8K-32K", "128K-512K", ">=512K", ">=512K"
    ]  # fmt: skip
    timings = {"queue_s": 0.5, "lookup_s": 0.25, "compute_s": 1.0, "publish_s": 0.25}
    phases = ttft_phases(2.5, timings)
    assert list(phases) == list(TTFT_PHASES)
    assert phases["control"] == 0.5 and phases["tier_pull"] == 0.0
    assert sum(phases.values()) == 2.5
    # Clocks of two processes: control's share never goes below zero.
    assert ttft_phases(1.0, timings)["control"] == 0.0
