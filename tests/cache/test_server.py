"""Real cache server processes (`kvrelay launch cache`) and CacheClients over tcp."""

import hashlib
import os
import signal
import subprocess
import sys
import time

import pytest

from kvrelay.cache.client import CacheClient, CacheClientConfig
from kvrelay.cache.l3 import open_store
from kvrelay.cache.tenants import tenant_key
from kvrelay.control.tier import TierProbe
from kvrelay.layout import ParallelConfig, rank_rectangle
from kvrelay.transfer import create_agent
from tests.cache.server_process import PAGE, TOKEN
from tests.cache.specs import SPEC

PAGES = 12
KEYS = SPEC.page_keys(list(range(SPEC.page_size * PAGES)))


def content(i: int) -> bytes:
    return hashlib.shake_128(b"page" + i.to_bytes(4, "little")).digest(PAGE)


async def rank_client(addresses, config: ParallelConfig, timeout_s=5.0, backend="tcp"):
    agent = await create_agent(backend, token=TOKEN)
    rect = rank_rectangle(SPEC, config)
    client = CacheClient(
        agent, SPEC, rect, CacheClientConfig(tuple(addresses), TOKEN, timeout_s=timeout_s)
    )
    local = agent.allocate_arena(PAGES * PAGE)
    return agent, client, local


async def write_pages(addresses, config: ParallelConfig, pages: range, backend="tcp") -> int:
    """Every rank of `config`'s group writes its rectangle of `pages`."""
    total = 0
    for rank in config.all_ranks():
        agent, client, local = await rank_client(addresses, rank, backend=backend)
        for i in pages:
            local.buffer(i * PAGE, PAGE)[:] = content(i)
        offsets = [i * PAGE for i in pages]
        total += await client.write([KEYS[i] for i in pages], local, offsets)
        await client.close()
        await agent.close()
    return total


async def read_pages(
    addresses, config: ParallelConfig, count: int, backend="tcp"
) -> tuple[list[int], bytes]:
    """Every rank of `config`'s group pulls its rectangle; returns hits per rank and the
    pages assembled from all ranks' rectangles."""
    assembled = bytearray(count * PAGE)
    hits = []
    for rank in config.all_ranks():
        agent, client, local = await rank_client(addresses, rank, backend=backend)
        hit = await client.lookup(KEYS[:count], local, [i * PAGE for i in range(count)])
        hits.append(hit)
        for i in range(hit):
            for offset, length in client.runs:
                start = i * PAGE + offset
                assembled[start : start + length] = local.buffer(start, length)
        await client.close()
        await agent.close()
    return hits, bytes(assembled)


def expected(count: int) -> bytes:
    return b"".join(content(i) for i in range(count))


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", ["tcp", "ucx"])
async def test_two_writer_configs_fill_pages_a_third_config_reads(servers, backend, monkeypatch):
    # UCX over shared memory and cma on one host; the server inherits the setting.
    monkeypatch.setenv("UCX_TLS", "sm,self")
    addresses = [servers(backend=backend).address, servers(backend=backend).address]

    stage0 = [r for r in ParallelConfig(tp=2, pp=2).all_ranks() if r.pp_rank == 0]
    for rank in stage0:
        agent, client, local = await rank_client(addresses, rank, backend=backend)
        for i in range(PAGES):
            local.buffer(i * PAGE, PAGE)[:] = content(i)
        await client.write(KEYS, local, [i * PAGE for i in range(PAGES)])
        await client.close()
        await agent.close()
    hits, _ = await read_pages(addresses, ParallelConfig(tp=4), PAGES, backend)
    assert hits == [0, 0, 0, 0]  # half of every page: nothing sealed
    agent, client, local = await rank_client(
        addresses, ParallelConfig(tp=1, pp=2, pp_rank=1), backend=backend
    )
    for i in range(PAGES):
        local.buffer(i * PAGE, PAGE)[:] = content(i)
    assert await client.write(KEYS, local, [i * PAGE for i in range(PAGES)]) == PAGES
    await client.close()
    await agent.close()
    hits, pages = await read_pages(addresses, ParallelConfig(tp=4), PAGES, backend)
    assert hits == [PAGES] * 4
    assert pages == expected(PAGES)
    agent, client, _ = await rank_client(addresses, ParallelConfig(tp=1), backend=backend)
    stats = await client.server_stats()
    assert sum(s["tier"]["sealed_pages"] for s in stats.values()) == PAGES
    assert sum(s["pages"] for s in stats.values()) == PAGES
    await client.close()
    await agent.close()


@pytest.mark.asyncio
async def test_restart_with_file_l3_keeps_pages_and_corruption_is_a_miss(servers, tmp_path):
    l3 = ["--l3", f"file:{tmp_path / 'l3'}", "--l3-gb", "0.01", "--l3-policy", "write-through"]
    first = servers(*l3)
    assert await write_pages([first.address], ParallelConfig(tp=2), range(8)) == 16
    first.stop()
    second = servers(*l3)

    async def main():
        hits, pages = await read_pages([second.address], ParallelConfig(tp=1), 8)
        assert hits == [8] and pages == expected(8)

    await main()
    second.stop()
    # Flip a byte of page 5's file (filed under its per-namespace key); a fresh
    # server promotes pages 0-4 only.
    filed = tenant_key(SPEC.namespace(), KEYS[5])
    path = next((tmp_path / "l3").glob(f"{SPEC.namespace().hex()}/??/{filed.hex()}.page"))
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    third = servers(*l3)

    async def again():
        hits, pages = await read_pages([third.address], ParallelConfig(tp=2), 8)
        assert hits == [5, 5] and pages[: 5 * PAGE] == expected(5)

    await again()
    assert not path.exists()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["valkey", "valkey-cluster"])
async def test_restart_with_valkey_l3_keeps_pages(servers, kind, request):
    if kind == "valkey":
        url = f"valkey://127.0.0.1:{request.getfixturevalue('valkey_server').port}"
    else:
        url = request.getfixturevalue("valkey_cluster").url
        open_store(url).flush()
    l3 = ["--l3", url]
    first = servers(*l3)  # write-back: pages reach valkey when evicted or at a clean stop
    assert await write_pages([first.address], ParallelConfig(tp=1), range(8)) == 8
    first.stop(signal.SIGKILL)
    # Killed before any eviction: nothing was demoted.
    second = servers(*l3)
    hits, _ = await read_pages([second.address], ParallelConfig(tp=1), 8)
    assert hits == [0]
    assert await write_pages([second.address], ParallelConfig(tp=1), range(8)) == 8
    second.stop()  # SIGTERM: demotes its sealed pages
    # A third server, another machine's in spirit, finds them in the shared store.
    third = servers(*l3)
    hits, pages = await read_pages([third.address], ParallelConfig(tp=2), 8)
    assert hits == [8, 8] and pages == expected(8)


@pytest.mark.asyncio
async def test_a_prompt_longer_than_the_servers_l2_is_read_whole_from_l3(servers, tmp_path):
    """One server whose L2 holds 4 pages, behind it a file L3 holding all 12
    of a prompt: a reader gets all 12 in turns of what L2 can pin at once."""
    l3 = ["--l3", f"file:{tmp_path / 'l3'}", "--l3-gb", "0.01", "--l3-policy", "write-through"]
    server = servers(*l3, pages=4)
    assert await write_pages([server.address], ParallelConfig(tp=1), range(PAGES)) == PAGES
    hits, pages = await read_pages([server.address], ParallelConfig(tp=2), PAGES)
    assert hits == [PAGES, PAGES]
    assert pages == expected(PAGES)
    agent, client, _ = await rank_client([server.address], ParallelConfig(tp=1))
    assert await client.count_prefix(KEYS) == PAGES
    await client.close()
    await agent.close()
    probe = TierProbe([server.address], TOKEN)
    try:
        assert await probe.probe(SPEC.namespace(), KEYS) == PAGES  # control's routing probe
    finally:
        probe.close()


@pytest.mark.asyncio
async def test_killed_server_degrades_to_misses(servers):
    a, b = servers(), servers()
    addresses = [a.address, b.address]
    assert await write_pages(addresses, ParallelConfig(tp=1), range(PAGES)) == PAGES
    a.stop(signal.SIGKILL)

    async def main():
        agent, client, local = await rank_client(addresses, ParallelConfig(tp=1), timeout_s=2)
        start = time.monotonic()
        hit = await client.lookup(KEYS, local, [i * PAGE for i in range(PAGES)])
        first_on_a = next(i for i, k in enumerate(KEYS) if client.ring.server_for(k) == a.address)
        assert hit == first_on_a
        assert bytes(local.buffer(0, hit * PAGE)) == expected(hit)
        # Writes to the dead server are dropped, the rest go in; nothing raises.
        # Four new keys with some on each server (placement follows the
        # servers' random ports; four consecutive keys all landed on b once).
        candidates = SPEC.page_keys(list(range(1000, 1000 + SPEC.page_size * 64)))
        fresh = next(
            window
            for window in (candidates[i : i + 4] for i in range(len(candidates) - 3))
            if {client.ring.server_for(k) for k in window} == {a.address, b.address}
        )
        on_b = sum(client.ring.server_for(k) == b.address for k in fresh)
        assert await client.write(fresh, local, [i * PAGE for i in range(4)]) == on_b
        assert client.stats.errors >= 2
        stats = await client.server_stats()
        assert stats[a.address] is None and stats[b.address]["tier"]["lookups"] >= 1
        assert time.monotonic() - start < 10
        await client.close()
        await agent.close()

    await main()


def test_cli_needs_a_token():
    env = {k: v for k, v in os.environ.items() if k != "KVRELAY_TOKEN"}
    result = subprocess.run(
        [sys.executable, "-m", "kvrelay.cli", "launch", "cache", "--page-bytes", "64",
         "--arena-gb", "0.001"],
        capture_output=True, env=env, timeout=60, text=True,
    )  # fmt: skip
    assert result.returncode != 0 and "token" in result.stderr
