"""Cache servers joining and leaving a running cluster: real server processes
register with a real control app, a shared Redis L3 behind them, and a client
workload that runs throughout."""

import asyncio
import hashlib

import pytest

from kvrelay.cache.client import CacheClient, CacheClientConfig
from kvrelay.control.cache_members import CacheMembers
from kvrelay.layout import ParallelConfig, rank_rectangle
from kvrelay.transfer import create_agent
from tests.cache.server_process import PAGE, TOKEN
from tests.cache.specs import SPEC
from tests.control.conftest import Control

PAGES = 48
KEYS = SPEC.page_keys(list(range(SPEC.page_size * PAGES)))
RECT = rank_rectangle(SPEC, ParallelConfig(tp=1))


def content(i: int) -> bytes:
    return hashlib.shake_128(b"member" + i.to_bytes(4, "little")).digest(PAGE)


@pytest.fixture
def control():
    c = Control(token=TOKEN, heartbeat_s=0.5)
    yield c
    c.close()


def ring(control) -> dict:
    return control.http.get("/v1/cache-ring", headers={"Authorization": f"Bearer {TOKEN}"}).json()


class Workload:
    """One rank's client: writes pages and reads prefixes back, checking every byte."""

    async def start(self, seeds):
        self.agent = await create_agent("tcp", token=TOKEN)
        config = CacheClientConfig(tuple(seeds), TOKEN, timeout_s=5, ring_poll_s=0.1)
        self.client = CacheClient(self.agent, SPEC, RECT, config)
        self.local = self.agent.allocate_arena(PAGES * PAGE)
        for i in range(PAGES):
            self.local.buffer(i * PAGE, PAGE)[:] = content(i)
        self.read_arena = self.agent.allocate_arena(PAGES * PAGE)
        self.requests = self.wrong = 0
        return self

    async def write(self, pages: range) -> int:
        return await self.client.write([KEYS[i] for i in pages], self.local,
                                       [i * PAGE for i in pages])  # fmt: skip

    async def read(self, count: int) -> int:
        """The prefix of the first `count` pages the tier answers, every byte checked."""
        hit = await self.client.lookup(KEYS[:count], self.read_arena,
                                       [i * PAGE for i in range(count)])  # fmt: skip
        self.requests += 1
        if bytes(self.read_arena.buffer(0, hit * PAGE)) != b"".join(map(content, range(hit))):
            self.wrong += 1
        return hit

    async def run(self, stop: asyncio.Event, written: int) -> list[int]:
        """Until `stop`: write the next page, read everything written so far."""
        hits = []
        while not stop.is_set():
            if written < PAGES:
                await self.write(range(written, written + 1))
                written += 1
            hits.append(await self.read(written))
            await asyncio.sleep(0.01)
        return hits

    async def close(self):
        await self.client.close()
        await self.agent.close()


async def follow(client, servers, timeout=15.0):
    """Until the client is on a ring of exactly `servers` (servers hear of a change
    at their next heartbeat, the client at its next poll)."""
    await wait_for(lambda: sorted(client.ring.servers) == sorted(servers), timeout, client)


async def wait_for(condition, timeout=15.0, client=None):
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        if client is not None:
            await client.refresh_ring()
        await asyncio.sleep(0.05)


def test_ring_versions():
    clock = [0.0]
    members = CacheMembers(("s:1",), heartbeat_s=1.0, clock=lambda: clock[0])
    seen = []
    members.listeners.append(seen.append)
    assert members.ring() == {"version": 1, "servers": ["s:1"]}
    a = members.register("a:1")
    members.heartbeat(a.server_id)
    b = members.register("b:1")
    assert members.ring() == {"version": 3, "servers": ["a:1", "b:1", "s:1"]}
    assert members.drain(a.server_id) and members.ring()["servers"] == ["b:1", "s:1"]
    assert members.deregister(a.server_id) and members.version == 4  # no change: same ring
    clock[0] = 2.0
    members.heartbeat(b.server_id)
    clock[0] = 3.5
    assert members.sweep() == [] and members.version == 4
    clock[0] = 5.1
    assert members.sweep() == [b.server_id]
    assert members.ring() == {"version": 5, "servers": ["s:1"]}
    assert seen == [["a:1", "s:1"], ["a:1", "b:1", "s:1"], ["b:1", "s:1"], ["s:1"]]
    # The static list stays whatever happens; a restarted server replaces itself.
    c1 = members.register("c:1")
    c2 = members.register("c:1")
    assert c1.server_id not in members.members and c2.server_id in members.members


@pytest.mark.asyncio
async def test_server_added_and_another_drained_under_load(control, valkey_server, servers):
    args = ["--l3", f"valkey://127.0.0.1:{valkey_server.port}", "--control", control.url,
            "--drain-grace-s", "1.0"]  # fmt: skip
    a, b = servers(*args), servers(*args)
    assert ring(control)["servers"] == sorted([a.address, b.address])
    work = await Workload().start([a.address])  # one seed: the rest comes from the ring
    try:
        await follow(work.client, [a.address, b.address])
        assert await work.write(range(24)) == 24
        on_a = [i for i in range(24) if work.client.ring.server_for(KEYS[i]) == a.address]
        assert on_a
        stop = asyncio.Event()
        load = asyncio.create_task(work.run(stop, 24))
        # A third server joins: it starts empty, the ring grows, the client follows.
        c = await asyncio.to_thread(servers, *args)
        await wait_for(lambda: c.address in work.client.ring.servers)
        # A leaves: its pages go to L3, it leaves the ring, serves the grace, exits.
        await asyncio.to_thread(a.stop)
        assert a.process.returncode == 0
        assert ring(control)["servers"] == sorted([b.address, c.address])
        await asyncio.sleep(0.5)  # the workload runs on without A
        stop.set()
        hits = await asyncio.wait_for(load, 30)
        assert work.wrong == 0 and work.client.stats.errors == 0, work.client.stats
        # A ring change may cost misses while servers hand pages to L3, never a
        # failed or wrong answer; the load ends hitting everything it wrote.
        assert len(hits) > 10 and hits[-1] == PAGES, hits
        # Every page comes back, A's former share from L3 through B and C.
        assert await work.read(PAGES) == PAGES
        assert work.wrong == 0
        stats = await work.client.server_stats()
        assert set(stats) == {b.address, c.address}
        promoted = sum(s["tier"]["promotions"] for s in stats.values())
        assert promoted >= len(on_a)
        assert stats[c.address]["tier"]["promotions"] > 0  # it filled from L3 on demand
    finally:
        await work.close()


@pytest.mark.asyncio
async def test_dead_servers_share_turns_into_l3_hits(control, valkey_server, servers):
    args = ["--l3", f"valkey://127.0.0.1:{valkey_server.port}", "--l3-policy", "write-through",
            "--control", control.url, "--drain-grace-s", "0.2"]  # fmt: skip
    a, b = servers(*args), servers(*args)
    work = await Workload().start([a.address, b.address])
    try:
        await follow(work.client, [a.address, b.address])
        assert await work.write(range(16)) == 16
        on_b = [i for i in range(16) if work.client.ring.server_for(KEYS[i]) == b.address]
        assert on_b
        b.kill()
        # Three missed heartbeats take B out of the ring; the client follows.
        await wait_for(lambda: ring(control)["servers"] == [a.address])
        await follow(work.client, [a.address])
        assert await work.read(16) == 16 and work.wrong == 0
        stats = (await work.client.server_stats())[a.address]
        assert stats["tier"]["promotions"] >= len(on_b)
    finally:
        await work.close()
