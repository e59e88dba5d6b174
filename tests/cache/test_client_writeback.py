"""The client's write-back policy and admin flush against real cache server processes."""

import asyncio
import hashlib
import signal
import time

import pytest

from kvrelay.cache.client import CacheClient, CacheClientConfig
from kvrelay.layout import ParallelConfig, rank_rectangle
from kvrelay.transfer import create_agent
from tests.cache.server_process import PAGE, TOKEN
from tests.cache.specs import SPEC

PAGES = 8
KEYS = SPEC.page_keys(list(range(SPEC.page_size * PAGES)))
OFFSETS = [i * PAGE for i in range(PAGES)]


def content(i: int) -> bytes:
    return hashlib.shake_128(b"wb" + i.to_bytes(4, "little")).digest(PAGE)


async def make_client(addresses, config: ParallelConfig | None = None, **options):
    config = config or ParallelConfig(tp=1)
    agent = await create_agent("tcp", token=TOKEN)
    client = CacheClient(
        agent, SPEC, rank_rectangle(SPEC, config), CacheClientConfig(tuple(addresses), TOKEN,
                                                                     **options)
    )  # fmt: skip
    return agent, client, agent.allocate_arena(PAGES * PAGE)


def fill(local, pages=range(PAGES)) -> None:
    for i in pages:
        local.buffer(i * PAGE, PAGE)[:] = content(i)


async def read_all(addresses) -> tuple[int, bytes]:
    agent, client, local = await make_client(addresses)
    hits = await client.lookup(KEYS, local, OFFSETS)
    data = bytes(local.buffer(0, hits * PAGE))
    await client.close()
    await agent.close()
    return hits, data


async def sealed(client) -> int:
    return sum(s["tier"]["sealed_pages"] for s in (await client.server_stats()).values())


async def wait_sealed(client, count: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while await sealed(client) < count:
        assert time.monotonic() < deadline, f"{count} pages not pushed within {timeout} s"
        await asyncio.sleep(0.05)


def expected(count: int) -> bytes:
    return b"".join(content(i) for i in range(count))


@pytest.mark.asyncio
async def test_write_back_queues_without_the_server_then_flush_pushes_copies(servers):
    server = servers()

    agent, client, local = await make_client(
        [server.address], write_policy="write-back", write_back_delay_s=60
    )
    fill(local)
    server.pause()  # a write-through write would now wait for its timeout
    try:
        assert await client.write(KEYS, local, OFFSETS) == PAGES
        assert client.stats.errors == 0 and client.stats.pending_pages == PAGES
    finally:
        server.resume()
    local.buffer(0, PAGES * PAGE)[:] = bytes(PAGES * PAGE)  # the caller reuses its memory
    assert (await read_all([server.address]))[0] == 0  # nothing pushed yet
    # The writer's own lookups see the waiting pages.
    assert await client.lookup(KEYS, local, OFFSETS) == PAGES
    assert bytes(local.buffer(0, PAGES * PAGE)) == expected(PAGES)
    assert client.stats.queue_hit_pages == PAGES
    assert await client.flush() == PAGES
    assert client.stats.pending_pages == 0 and client.stats.written_pages == PAGES
    assert await read_all([server.address]) == (PAGES, expected(PAGES))
    with pytest.raises(ValueError):
        await client.write(KEYS[:2], local, OFFSETS[:1])
    # Already sealed: queued, pushed, not written again.
    assert await client.write(KEYS[:2], local, OFFSETS[:2]) == 2
    assert await client.flush() == 0 and client.stats.written_pages == PAGES
    await client.close()
    await agent.close()


@pytest.mark.asyncio
async def test_background_push_after_the_delay_or_a_full_batch(servers):
    server = servers()

    agent, client, local = await make_client(
        [server.address], write_policy="write-back", write_back_delay_s=0.2
    )
    fill(local)
    await client.write(KEYS[:3], local, OFFSETS[:3])
    await wait_sealed(client, 3)
    await client.close()
    # A batch of 4 goes at once even with a long delay.
    agent2, batcher, local2 = await make_client(
        [server.address], write_policy="write-back", write_back_delay_s=600,
        write_back_batch=4,
    )  # fmt: skip
    fill(local2)
    await batcher.write(KEYS[3:5], local2, OFFSETS[3:5])
    await asyncio.sleep(0.3)
    assert await sealed(batcher) == 3  # 2 waiting: below the batch
    await batcher.write(KEYS[5:7], local2, OFFSETS[5:7])
    await wait_sealed(batcher, 7)
    assert batcher.stats.pending_pages == 0
    await batcher.close()
    for a in (agent, agent2):
        await a.close()
    assert await read_all([server.address]) == (7, expected(7))


@pytest.mark.asyncio
async def test_tp_ranks_write_back_and_close_loses_nothing(servers):
    addresses = [servers().address, servers().address]

    for rank in ParallelConfig(tp=2).all_ranks():
        agent, client, local = await make_client(
            addresses, rank, write_policy="write-back", write_back_delay_s=600
        )
        fill(local)
        assert await client.write(KEYS, local, OFFSETS) == PAGES
        await client.close()  # a clean close pushes what waits
        assert client.stats.written_pages == PAGES and client.stats.dropped_pages == 0
        await agent.close()
    assert await read_all(addresses) == (PAGES, expected(PAGES))


@pytest.mark.asyncio
async def test_full_queue_and_dead_server_drop_pages(servers):
    server = servers()

    agent, client, local = await make_client(
        [server.address], write_policy="write-back", write_back_delay_s=600,
        write_back_pages=4, write_back_batch=4, timeout_s=1.0,
    )  # fmt: skip
    fill(local)
    server.stop(signal.SIGKILL)
    assert await client.write(KEYS[:6], local, OFFSETS[:6]) == 4
    assert client.stats.dropped_pages == 2 and client.stats.queued_pages == 4
    start = time.monotonic()
    await client.flush()
    assert time.monotonic() - start < 5
    assert client.stats.dropped_pages == 6 and client.stats.written_pages == 0
    assert client.stats.errors >= 1 and client.stats.pending_pages == 0
    await client.close()
    await agent.close()


def test_config_is_checked():
    with pytest.raises(ValueError):
        CacheClientConfig(("a:1",), TOKEN, write_policy="write-around")
    with pytest.raises(ValueError):
        CacheClientConfig(("a:1",), TOKEN, write_back_pages=4, write_back_batch=5)


@pytest.mark.asyncio
async def test_admin_flush_reaches_pages_only_l3_holds(servers, tmp_path):
    l3 = ["--l3", f"file:{tmp_path / 'l3'}", "--l3-gb", "0.01", "--l3-policy", "write-through"]
    first = servers(*l3)

    async def write(address):
        agent, client, local = await make_client([address])
        fill(local)
        assert await client.write(KEYS, local, OFFSETS) == PAGES
        await client.close()
        await agent.close()

    await write(first.address)
    first.stop()
    second = servers(*l3)  # L2 empty: the pages live in L3 only

    async def main():
        agent, client, local = await make_client([second.address])
        other = hashlib.sha256(b"another tenant").digest()
        assert await client.admin_flush(other) == {second.address: {"dropped": 0, "l3_dropped": 0}}
        assert await client.admin_flush(SPEC.namespace()) == {
            second.address: {"dropped": 0, "l3_dropped": PAGES}
        }
        assert await client.lookup(KEYS, local, OFFSETS) == 0
        await client.close()
        await agent.close()

    await main()
    assert not list((tmp_path / "l3").glob("*/??/*.page"))
