"""kvrelay across two hosts: network namespaces joined by a veth pair. Control,
a cache server and prefill run on host A (198.18.0.1), decode on host B
(198.18.0.2); pages move by UCX over tcp (or kvrelay's tcp backend without UCX)
between them, with no same-host shortcut: UCX is held to tcp and each
namespace counts as another host for kvrelay's fast path. Requests go to
control from inside host A. Tokens are compared with `kvrelay generate` in one
process (float64)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from kvrelay.demo.cluster import ClusterConfig, LocalCluster, PoolConfig, Process, _pump, free_port
from kvrelay.model.config import ModelConfig
from kvrelay.model.loader import kv_spec
from kvrelay.transfer import available
from tests.integration.test_cluster import DTYPE, PAGE, generate, rng_tokens
from tests.multihost.netns import TwoHosts

BACKEND = "ucx" if available("ucx") else "tcp"
TIMEOUT_S = 120


class TwoHostCluster(LocalCluster):
    """LocalCluster's processes placed on two hosts: decode on B, the rest on A."""

    def __init__(self, config: ClusterConfig, hosts: TwoHosts) -> None:
        super().__init__(config)
        self.hosts = hosts

    def host_of(self, name: str) -> int:
        return 1 if name.startswith("decode") else 0

    def _start(self, name: str, args: list[str]) -> Process:
        host = self.host_of(name)
        address = self.hosts.addresses[host]
        # Control and the cache server run on A: every address the base class
        # names is there; each server listens on its own host's address.
        args = [a.replace("127.0.0.1", self.hosts.addresses[0]) for a in args]
        if args[0] == "launch" and args[1] != "control":
            args += ["--listen", f"{address}:0"]
        env = os.environ | {"PYTHONUNBUFFERED": "1", "KVRELAY_TOKEN": self.config.token,
                            "UCX_TLS": "tcp"}  # fmt: skip
        log = self.config.log_dir / f"{name}.log"
        log.write_text(f"$ kvrelay {' '.join(args)} (on {address})\n")
        popen = subprocess.Popen(
            self.hosts.command(host, [sys.executable, "-m", "kvrelay.cli", *args]),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            text=True, env=env, start_new_session=True,
        )  # fmt: skip
        process = Process(name, popen, log)
        process._pump = threading.Thread(target=_pump, args=(process,), daemon=True)
        process._pump.start()
        self.processes.append(process)
        return process

    def start(self) -> TwoHostCluster:
        super().start()
        self.control_url = self.control_url.replace("127.0.0.1", self.hosts.addresses[0])
        return self


def complete_on_a(hosts: TwoHosts, url: str, prompt: list[int], max_tokens: int) -> dict:
    """A completion sent from inside host A (the test runs outside both)."""
    script = (
        "import httpx, json, sys; body = json.loads(sys.stdin.read()); "
        f"r = httpx.post('{url}/v1/completions', json=body, timeout={TIMEOUT_S}); "
        "print(json.dumps({'status': r.status_code, 'body': r.json()}))"
    )
    result = subprocess.run(
        hosts.command(0, [sys.executable, "-c", script]),
        input=json.dumps({"prompt": prompt, "max_tokens": max_tokens}),
        capture_output=True, text=True, timeout=TIMEOUT_S + 30,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    answer = json.loads(result.stdout)
    assert answer["status"] == 200, answer
    return answer["body"]


def stats_on_a(hosts: TwoHosts, url: str) -> dict:
    script = f"import httpx; print(httpx.get('{url}/stats', timeout=10).text)"
    result = subprocess.run(hosts.command(0, [sys.executable, "-c", script]),
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    return json.loads(result.stdout)


@pytest.fixture
def two_hosts():
    hosts = TwoHosts().create()
    try:
        yield hosts
    finally:
        hosts.remove()


def test_prefill_on_one_host_decode_on_another(model_dirs, tmp_path, two_hosts):
    model_dir = model_dirs("cluster")
    page_bytes = kv_spec(model_dir, ModelConfig.from_dir(model_dir), DTYPE, PAGE).page_bytes
    config = ClusterConfig(
        model_dir=model_dir, log_dir=tmp_path / "logs", prefill=PoolConfig(tp=1),
        decode=PoolConfig(tp=1), page_bytes=page_bytes, page_size=PAGE, dtype=DTYPE,
        prefill_pages=128, decode_pages=128, cache_gb=0.02, backend=BACKEND,
        control_port=free_port(),
    )  # fmt: skip
    cluster = TwoHostCluster(config, two_hosts).start()
    try:
        url = cluster.control_url
        nodes = {n["role"]: n["address"] for n in stats_on_a(two_hosts, url)["nodes"]}
        assert nodes["prefill"].startswith("198.18.0.1:")
        assert nodes["decode"].startswith("198.18.0.2:")
        prompt = rng_tokens(21, 90)
        first = complete_on_a(two_hosts, url, prompt, 8)
        assert first["choices"][0]["token_ids"] == generate(model_dir, prompt, 8)
        # The next turn: its context comes from prefill's pool and the tier on
        # host A, pulled across to decode on host B.
        turn = prompt + first["choices"][0]["token_ids"] + rng_tokens(22, 30)
        second = complete_on_a(two_hosts, url, turn, 8)
        assert second["choices"][0]["token_ids"] == generate(model_dir, turn, 8)
        cached = second["kvrelay"]["cached_tokens"]
        assert cached["local"] + cached["tier"] >= len(prompt) // PAGE * PAGE
        s = stats_on_a(two_hosts, url)
        assert s["errors"] == 0 and s["completed"] == 2
        # A worker's counters reach control with its heartbeats (1 s apart).
        deadline = time.monotonic() + 15
        while True:
            moved = next(n for n in s["nodes"] if n["role"] == "decode")["counters"]
            if moved.get("bytes_from_prefill", 0) > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
            s = stats_on_a(two_hosts, url)
        assert moved.get("bytes_from_prefill", 0) > 0
    finally:
        cluster.stop()
