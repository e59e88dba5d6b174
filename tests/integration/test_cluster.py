"""The whole system as a user starts it: `kvrelay launch control`, a cache
server, prefill and decode pools, all real processes on loopback (started by
`kvrelay.demo.cluster.LocalCluster` through the CLI), driven over HTTP.
Tokens are compared with `kvrelay generate` in one process (float64, so TP
and PP agree with TP=1 to rounding and greedy choices cannot flip)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import threading
import time

import httpx
import numpy as np
import pytest

from kvrelay.cli import main as kvrelay_main
from kvrelay.demo.cluster import ClusterConfig, LocalCluster, PoolConfig
from kvrelay.model.config import ModelConfig
from kvrelay.model.loader import kv_spec

PAGE = 16
DTYPE = "float64"
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def model_dir(model_dirs):
    return model_dirs("cluster")


def start_cluster(model_dir, tmp_path, prefill: PoolConfig, decode: PoolConfig) -> LocalCluster:
    page_bytes = kv_spec(model_dir, ModelConfig.from_dir(model_dir), DTYPE, PAGE).page_bytes
    config = ClusterConfig(
        model_dir=model_dir, log_dir=tmp_path / "logs", prefill=prefill, decode=decode,
        page_bytes=page_bytes, page_size=PAGE, dtype=DTYPE, prefill_pages=256,
        decode_pages=256, cache_gb=0.05,
    )  # fmt: skip
    return LocalCluster(config).start()


def generate(model_dir, prompt, max_tokens, temperature=0.0, seed=0) -> list[int]:
    """`kvrelay generate` in one process."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        kvrelay_main([
            "generate", "--model", str(model_dir), "--prompt-ids", ",".join(map(str, prompt)),
            "--max-new-tokens", str(max_tokens), "--dtype", DTYPE, "--page-size", str(PAGE),
            "--temperature", str(temperature), "--seed", str(seed), "--json",
        ])  # fmt: skip
    return json.loads(out.getvalue())["tokens"]


def complete(url, prompt, max_tokens, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, **extra}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT_S)
    assert reply.status_code == 200, reply.text
    return reply.json()


def tokens_of(answer: dict) -> list[int]:
    return answer["choices"][0]["token_ids"]


def cached(answer: dict) -> tuple[int, int]:
    c = answer["kvrelay"]["cached_tokens"]
    return c["local"], c["tier"]


def stats(url) -> dict:
    return httpx.get(f"{url}/stats", timeout=10).json()


def rng_tokens(seed: int, count: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, count).tolist()


def test_pd_with_the_tier_equals_one_process_and_reuses_across_configs(model_dir, tmp_path):
    cluster = start_cluster(model_dir, tmp_path, PoolConfig(tp=2), PoolConfig(tp=1))
    try:
        url = cluster.control_url
        # Turn 1 through prefill TP=2 -> decode TP=1: greedy, and seeded sampling.
        p1 = rng_tokens(1, 150)
        a1 = complete(url, p1, 12)
        assert tokens_of(a1) == generate(model_dir, p1, 12)
        sampled = complete(url, rng_tokens(2, 70), 10, temperature=0.9, seed=11)
        assert tokens_of(sampled) == generate(model_dir, rng_tokens(2, 70), 10, 0.9, 11)

        # Turn 2 resends the conversation: the whole previous context with KV
        # (prompt and answer but its last token) is served, from prefill's pool
        # and from the tier (decode wrote the answer's pages back).
        p2 = p1 + tokens_of(a1) + rng_tokens(3, 40)
        a2 = complete(url, p2, 12)
        assert tokens_of(a2) == generate(model_dir, p2, 12)
        context = (len(p1) + 12 - 1) // PAGE * PAGE
        local, tier = cached(a2)
        assert local + tier >= context
        assert tier > 0  # pages past the prompt exist only as decode's write-back

        # Redeploy: prefill PP=2 and decode TP=2 (new processes, empty pools).
        cluster.redeploy("prefill", PoolConfig(tp=1, pp=2))
        cluster.redeploy("decode", PoolConfig(tp=2))
        p3 = p2 + tokens_of(a2) + rng_tokens(4, 40)
        a3 = complete(url, p3, 12)
        assert tokens_of(a3) == generate(model_dir, p3, 12)
        local, tier = cached(a3)
        assert local == 0 and tier == (len(p2) + 12 - 1) // PAGE * PAGE

        s = stats(url)
        assert s["errors"] == 0 and s["completed"] == 4
        assert s["tokens"]["tier"] >= tier
    finally:
        cluster.stop()


def node_process(cluster, node_id):
    return next(p for p in cluster.processes if (p.ready or {}).get("node_id") == node_id)


def decode_free_pages(url) -> int:
    return next(n["free_pages"] for n in stats(url)["nodes"] if n["role"] == "decode")


def test_a_killed_prefill_worker_is_retried_elsewhere_then_fails_clearly(model_dir, tmp_path):
    cluster = start_cluster(model_dir, tmp_path, PoolConfig(workers=2), PoolConfig())
    try:
        url = cluster.control_url
        warm = rng_tokens(5, 40)
        complete(url, warm, 4)
        time.sleep(2.5)  # a heartbeat reports decode's pool after that request
        free_before = decode_free_pages(url)
        prompt = rng_tokens(6, 600)
        result: dict = {}
        # Freeze both prefill workers, so the request is surely in flight on
        # one of them when it is found; then the other goes on and the one
        # holding the request is killed. (Well inside the 3 s a node may miss
        # heartbeats for.)
        prefills = [p for p in cluster.processes if p.name.startswith("prefill")]
        for process in prefills:
            os.killpg(process.popen.pid, signal.SIGSTOP)
        request = threading.Thread(target=lambda: result.update(complete(url, prompt, 8)))
        request.start()
        deadline = time.monotonic() + 2.0
        busy = []
        while not busy and time.monotonic() < deadline:
            busy = [n for n in stats(url)["nodes"] if n["role"] == "prefill" and n["inflight"]]
            time.sleep(0.005)
        assert busy, "the request never reached a prefill worker"
        victim = node_process(cluster, busy[0]["node_id"])
        for process in prefills:
            if process is not victim:
                os.killpg(process.popen.pid, signal.SIGCONT)
        os.killpg(victim.popen.pid, signal.SIGKILL)
        request.join(TIMEOUT_S)
        assert not request.is_alive()
        assert tokens_of(result) == generate(model_dir, prompt, 8)
        assert result["kvrelay"]["prefill_node"] != busy[0]["node_id"]
        assert stats(url)["retries"] >= 1
        # Decode's pool returns to where it was once the request is done.
        deadline = time.monotonic() + 30
        while decode_free_pages(url) != free_before and time.monotonic() < deadline:
            time.sleep(0.2)
        assert decode_free_pages(url) == free_before

        # With no prefill worker left, a request fails with a reason, in time.
        survivor = next(p for p in cluster.processes if p.name.startswith("prefill")
                        and p is not victim)  # fmt: skip
        os.killpg(survivor.popen.pid, signal.SIGKILL)
        started = time.monotonic()
        reply = httpx.post(f"{url}/v1/completions", json={"prompt": warm, "max_tokens": 4},
                           timeout=TIMEOUT_S)  # fmt: skip
        assert reply.status_code in (502, 503), reply.text
        assert reply.json().get("error") or reply.json().get("detail")
        assert time.monotonic() - started < 60
    finally:
        cluster.stop()
