"""Hostile frames on every listening socket of a real cluster (cache server,
its transfer agent, prefill and decode fronts), drawn by hypothesis from the
families in `kvrelay.chaos.hostile`: each is refused with a typed error (or,
cut short, closed), nothing is answered as if valid, no process logs an
unhandled error, and every server still answers a good request after."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrelay.chaos import frames, hostile, setup
from tests.chaos.conftest import PAGE, open_fds, run

SERVERS = ("cache", "agent", "prefill", "decode")


@pytest.fixture(scope="module")
def targets(small_cluster):
    c = small_cluster
    token, page_bytes = c.config.token, c.config.page_bytes
    cache_address = c.cache_addresses[0]
    cache, agent = run(setup.cache_targets(cache_address, token, page_bytes, 256 * page_bytes))
    # A real handle of the cache's agent, in the chaos tenant's namespace: the
    # workers' namespace differs, so decode must refuse to read it.
    _, fields = run(setup.reserved_handle(cache_address, token, page_bytes, b"\x42" * 32, 60))
    prefill = c.named("prefill")[0].ready["address"]
    decode = c.named("decode")[0].ready["address"]
    workers = run(setup.worker_targets(prefill, decode, token, 256, PAGE, fields["raw"]))
    return {"cache": cache, "agent": agent, "prefill": workers[0], "decode": workers[1]}


def process_of(cluster, server: str):
    return cluster.named("cache" if server in ("cache", "agent") else server)[0]


@pytest.mark.parametrize("server", SERVERS)
def test_hostile_frames_are_refused_and_the_server_keeps_serving(server, targets, small_cluster):
    target = targets[server]
    seen = []

    @settings(max_examples=40, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(family=st.sampled_from(hostile.FAMILIES), seed=st.integers(0, 2**32 - 1))
    def one(family, seed):
        case = hostile.make_case(target, family, random.Random(seed))
        if case is None:
            return
        outcome = run(hostile.run_case(target, case, timeout=15))
        seen.append(family)
        ok = outcome.kind == frames.REFUSED or (case.may_close and outcome.kind == frames.CLOSED)
        assert ok, (family, case.payload[:300], outcome)

    one()
    assert len(set(seen)) >= 5, seen
    assert run(hostile.still_serving(target))
    process = process_of(small_cluster, server)
    assert process.popen.poll() is None
    assert small_cluster.unhandled_errors() == dict.fromkeys(small_cluster.unhandled_errors(), 0)


@pytest.mark.asyncio
@pytest.mark.parametrize("server", SERVERS)
async def test_every_family_runs_clean(server, targets, small_cluster):
    """A fixed number of each family (the same runner as `kvrelay bench chaos`)."""
    process = process_of(small_cluster, server)
    for family in hostile.FAMILIES:
        result = await hostile.run_family(targets[server], family, 25, seed=7,
                                          alive=lambda: process.popen.poll() is None)  # fmt: skip
        assert result.crashes == 0, result.as_dict()
        assert result.rejected == result.tried, (result.as_dict(), result.samples)


@pytest.mark.asyncio
@pytest.mark.parametrize("trickle_s", [None, 0.5], ids=["silent", "one-byte-at-a-time"])
async def test_slow_clients_are_dropped_and_hold_nothing(trickle_s, targets, small_cluster):
    """20 such clients on each server at once: all dropped after the 2 s
    hello deadline, the server still answers, its open sockets go back."""
    pids = {s: process_of(small_cluster, s).popen.pid for s in SERVERS}
    before = {s: open_fds(pid) for s, pid in pids.items()}

    dropped = await asyncio.gather(*(
        frames.silent_client_dropped(targets[s].address, trickle_s=trickle_s, limit=15)
        for s in SERVERS for _ in range(20)))  # fmt: skip
    assert all(dropped)
    for server in SERVERS:
        assert await hostile.still_serving(targets[server]), server
    deadline = time.monotonic() + 10  # a server sees the last close a moment later
    for server, pid in pids.items():
        while open_fds(pid) > before[server]:
            assert time.monotonic() < deadline, f"{server}: dropped clients' sockets stay open"
            await asyncio.sleep(0.1)
