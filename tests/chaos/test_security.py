"""Security of a real cluster: every listener wants the cluster token, a
lease reads only its own pages, another tenant's salt never hits, exposed
arenas are page-sized, the token appears in no log, stats, metrics or
command line, and every listener is bound to loopback."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import urllib.error
import urllib.request
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

from kvrelay.cache.client import CacheClient, CacheClientConfig
from kvrelay.chaos import frames, setup
from kvrelay.layout import ParallelConfig, rank_rectangle
from kvrelay.model.config import ModelConfig
from kvrelay.model.loader import kv_spec
from kvrelay.procfs import descendants
from kvrelay.transfer import create_agent
from tests.chaos.conftest import DTYPE, PAGE


async def listeners(cluster) -> dict[str, str]:
    c = cluster
    out = {"cache": c.cache_addresses[0]}
    for role in ("prefill", "decode"):
        out[role] = c.named(role)[0].ready["address"]
    agent, _ = await setup.reserved_handle(out["cache"], c.config.token, c.config.page_bytes,
                                           b"\x07" * 32, 30)  # fmt: skip
    out["cache agent"] = agent
    return out


@pytest.mark.asyncio
async def test_every_listener_refuses_a_wrong_or_missing_token(small_cluster):
    for name, address in (await listeners(small_cluster)).items():
        wrong = await frames.probe(address, frames.frame({"op": "stats"}), token="not-the-token")
        assert wrong.kind == frames.BAD_REPLY and wrong.reply["error"] == "AuthError", name
        skipped = await frames.probe(address, frames.frame({"op": "stats"}), token=None)
        assert skipped.kind == frames.REFUSED and skipped.error == "AuthError", name


def http(url: str, method: str = "GET", body=None, token: str | None = None) -> tuple[int, str]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_registration_and_admin_need_the_token(small_cluster):
    url = small_cluster.control_url
    routes = [("POST", "/v1/nodes", {"role": "prefill"}), ("POST", "/v1/nodes/n1/heartbeat", {}),
              ("DELETE", "/v1/nodes/n1", None), ("POST", "/admin/flush", {}),
              ("POST", "/admin/drain", {})]  # fmt: skip
    for method, path, body in routes:
        assert http(url + path, method, body)[0] == 401, path
        assert http(url + path, method, body, token="wrong")[0] == 403, path


@pytest.mark.asyncio
async def test_a_lease_reads_only_its_own_pages(small_cluster):
    """A reader holding a lease on one cache page asks the agent for the
    page next to it (inside the arena, outside the lease): refused."""
    c = small_cluster
    token, page_bytes = c.config.token, c.config.page_bytes
    agent, fields = await setup.reserved_handle(c.cache_addresses[0], token, page_bytes,
                                                b"\x21" * 32, 30)  # fmt: skip
    own = np.frombuffer(fields["runs"], "<u8").reshape(-1, 2)
    size = 256 * page_bytes
    neighbour = (int(own[0, 0]) + page_bytes) % size
    for offset, length in [(neighbour, page_bytes), (int(own[0, 0]), page_bytes + 1),
                           (int(own[0, 0]) - 1 if own[0, 0] else size - 1, 1)]:  # fmt: skip
        request = {"op": "read", "arena": fields["arena"], "lease": fields["lease"],
                   "runs": np.array([offset, length], "<u8").tobytes()}  # fmt: skip
        outcome = await frames.probe(agent, frames.frame(request), token=token)
        assert outcome.kind == frames.REFUSED and outcome.error == "RunOutOfBounds", outcome
    own_read = {"op": "read", "arena": fields["arena"], "lease": fields["lease"],
                "runs": fields["runs"]}  # fmt: skip
    outcome = await frames.probe(agent, frames.frame(own_read), token=token)
    assert outcome.kind == frames.ACCEPTED and outcome.reply["nbytes"] == page_bytes


@pytest.mark.asyncio
async def test_another_tenants_salt_never_hits(small_cluster, chaos_model):
    """Tenant A writes pages; tenant B (same model, same tokens, another
    salt) looks them up: 0 hits, and nothing lands in B's memory."""
    model_dir, _ = chaos_model
    spec_a = kv_spec(model_dir, ModelConfig.from_dir(model_dir), DTYPE, PAGE)
    spec_a = dataclasses.replace(spec_a, salt="tenant-a")
    spec_b = dataclasses.replace(spec_a, salt="tenant-b")
    tokens = list(range(4 * PAGE))
    pb = spec_a.page_bytes

    agent = await create_agent("tcp", token=small_cluster.config.token)
    rect = rank_rectangle(spec_a, ParallelConfig())
    config = CacheClientConfig(tuple(small_cluster.cache_addresses),
                               small_cluster.config.token)  # fmt: skip
    local = agent.allocate_arena(4 * pb)
    clients = []
    try:
        local.tensor.copy_(torch.randint(0, 255, (4 * pb,), dtype=torch.uint8))
        writer = CacheClient(agent, spec_a, rect, config)
        clients.append(writer)
        written = await writer.write(spec_a.page_keys(tokens), local, [i * pb for i in range(4)])
        assert written == 4
        mine = local.tensor.clone()
        local.tensor.zero_()
        other = CacheClient(agent, spec_b, rect, config)
        clients.append(other)
        assert await other.lookup(spec_b.page_keys(tokens), local, [i * pb for i in range(4)]) == 0
        assert int(local.tensor.count_nonzero()) == 0
        same = CacheClient(agent, spec_a, rect, config)
        clients.append(same)
        assert await same.lookup(spec_a.page_keys(tokens), local, [i * pb for i in range(4)]) == 4
        assert torch.equal(local.tensor, mine)
    finally:
        for client in clients:  # their server connections, before the agent
            await client.close()
        await agent.close()


@pytest.mark.asyncio
async def test_exposed_arenas_hold_only_kv_pages(small_cluster):
    """The arena tables that agents show peers: the cache's page arena and
    each worker rank's staging arena, all whole pages, nothing else."""
    c = small_cluster
    token, page_bytes = c.config.token, c.config.page_bytes
    agent, _ = await setup.reserved_handle(c.cache_addresses[0], token, page_bytes, b"\x33" * 32,
                                           5)  # fmt: skip
    answer = await _hello(agent, token)
    assert [a[2] for a in answer["arenas"]] == [256 * page_bytes]
    prefill = c.named("prefill")[0].ready["address"]
    params = {"max_new_tokens": 2, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0,
              "stop_token_ids": []}  # fmt: skip
    reply = await frames.call(prefill, {"op": "prefill", "rid": "sec",
                                        "tokens": frames.tokens(range(40)),
                                        "params": params, "lease_s": 2.0}, token)  # fmt: skip
    assert frames.accepted(reply), reply
    handle = msgpack.unpackb(reply["handles"][0]["handle"], raw=False)
    arenas = (await _hello(handle["agent"], token))["arenas"]
    rows = c.chaos.staging_pages or c.chaos.pages  # staging rows of each rank
    assert arenas and all(a[2] == rows * page_bytes for a in arenas), arenas


async def _hello(address: str, token: str) -> dict:
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(frames.hello(token))
        return await asyncio.wait_for(frames.read_frame(reader), 10)
    finally:
        writer.close()
        await writer.wait_closed()


@pytest.mark.asyncio
async def test_the_token_is_in_no_log_stats_metrics_or_command_line(small_cluster):
    c = small_cluster
    token = c.config.token
    body = {"prompt": list(range(1, 40)), "max_tokens": 4}
    status, answer = await asyncio.to_thread(http, c.control_url + "/v1/completions", "POST", body)
    assert status == 200, answer
    texts = {}
    for route in ("/stats", "/metrics"):
        texts[route] = (await asyncio.to_thread(http, c.control_url + route))[1]
    for process in c.named("prefill") + c.named("decode"):
        texts[process.name] = json.dumps(await c.worker_stats(process))
    texts["cache stats"] = repr(await c.cache_stats(c.cache_addresses[0]))
    for path in c.config.log_dir.glob("*.log"):
        texts[path.name] = path.read_text(errors="replace")
    for process in c.processes:
        for pid in [process.popen.pid, *descendants(process.popen.pid)]:
            texts[f"cmdline {pid}"] = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
    assert len(texts) > 6
    assert not [name for name, text in texts.items() if token in text]


def listening_addresses(pid: int) -> list[str]:
    """host:port of every listening TCP socket the process holds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    out.append(cols[1])
    return out


def test_every_listener_binds_loopback(small_cluster):
    seen = 0
    for process in small_cluster.processes:
        for pid in [process.popen.pid, *descendants(process.popen.pid)]:
            for address in listening_addresses(pid):
                host = address.split(":")[0]
                assert host == "0100007F", (process.name, pid, address)  # 127.0.0.1
                seen += 1
    assert seen >= 5
    if small_cluster.valkey is not None:
        assert all(a.split(":")[0] == "0100007F"
                   for a in listening_addresses(small_cluster.valkey.process.pid))  # fmt: skip


@pytest.fixture(autouse=True)
def _no_unhandled_errors(small_cluster):
    yield
    assert not any(small_cluster.unhandled_errors().values()), small_cluster.unhandled_errors()
