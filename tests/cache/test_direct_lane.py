"""`DirectLane`: a cache client's reads and writes made on the caller's thread,
against a real cache server process, and the calls it leaves to the loop."""

import asyncio
import contextlib
import dataclasses
import time

import pytest
import torch

from kvrelay.cache import direct_lane
from kvrelay.cache.direct_lane import DirectLane, LaneShare
from kvrelay.cache.policy import WritePolicy
from kvrelay.layout import ParallelConfig
from kvrelay.rpc.cache_ops import Commit
from tests.cache.server_process import PAGE
from tests.cache.specs import SPEC
from tests.cache.test_server import KEYS, PAGES, content, rank_client


class RunsCopier:
    """Local pages (a [pages, PAGE] uint8 tensor) to and from the client's
    runs of the slots in the mapped arena, run by run (the `SlotCopier` an
    engine's compiled gather replaces)."""

    def __init__(self, pages: torch.Tensor, during=None) -> None:
        self.pages = pages
        self.during = during  # called once the copy is done, before it returns

    def copy_slots(self, arena, client, slots, positions, *, to_slots: bool) -> bool:
        for position, slot in zip(positions, slots, strict=True):
            for in_page, length in client.runs:
                offset = int(slot) * client.slot_bytes + in_page
                remote = arena[offset : offset + length]
                local = self.pages[position, in_page : in_page + length]
                (remote if to_slots else local).copy_(local if to_slots else remote)
        if self.during is not None:
            self.during()
        return True


async def _tier_stats_when(client, server, ready, timeout_s: float = 10.0) -> dict:
    """The server's tier stats once `ready(stats)` (a posted Touch is served
    on its own connection, in its own time)."""
    deadline = time.monotonic() + timeout_s
    while True:
        tier = (await client.server_stats())[server.address]["tier"]
        if ready(tier) or time.monotonic() > deadline:
            return tier
        await asyncio.sleep(0.02)


@pytest.fixture
def every_commit_posted(monkeypatch):
    """Lanes post every write's commit (not only 16 MiB and more)."""
    monkeypatch.setattr(direct_lane, "POST_COMMIT_BYTES", 0)


@contextlib.asynccontextmanager
async def _lanes(servers, count: int = 1):
    """A cache server process, a rank's client of it, and `count` lanes of
    that client sharing their boards and posted commits; everything closed after."""
    server = servers()
    agent, client, local = await rank_client([server.address], ParallelConfig())
    share = LaneShare()
    lanes = [DirectLane(client, share) for _ in range(count)]
    try:
        yield server, client, local, lanes
    finally:
        for lane in lanes:
            lane.close()
        await client.close()
        await agent.close()


async def _meet(client, local) -> None:
    """A first page written by the loop: the agent meets the server's."""
    local.buffer(0, PAGE)[:] = content(0)
    assert await client.write(KEYS[:1], local, [0]) == 1


def _pages() -> torch.Tensor:
    return torch.stack([torch.frombuffer(bytearray(content(i)), dtype=torch.uint8)
                        for i in range(PAGES)])  # fmt: skip


@pytest.mark.asyncio
async def test_a_lane_moves_pages_on_the_callers_thread_once_the_agent_met_the_server(servers):
    truth = _pages()
    async with _lanes(servers) as (server, client, local, (lane,)):
        # Not met yet: the call is the loop's, and the lane reserved nothing.
        assert await asyncio.to_thread(lane.write, KEYS, RunsCopier(truth)) is None
        assert (await client.server_stats())[server.address]["tier"]["reserved_pages"] == 0
        for i in range(2):
            local.buffer(i * PAGE, PAGE)[:] = content(i)
        assert await client.write(KEYS[:2], local, [0, PAGE]) == 2  # meets the server's agent
        # Pages already sealed are skipped; the rest go in from this thread.
        assert await asyncio.to_thread(lane.write, KEYS, RunsCopier(truth)) == PAGES - 2
        out = RunsCopier(torch.zeros_like(truth))
        assert await asyncio.to_thread(lane.read, KEYS, out) == PAGES
        assert torch.equal(out.pages, truth)
        assert lane.board_reads == 1  # off the server's slot board: no lookup
        gap = [*KEYS[:3], SPEC.page_keys(list(range(1000, 1000 + SPEC.page_size)))[0]]
        assert await asyncio.to_thread(lane.read, gap, RunsCopier(torch.zeros_like(truth))) == 3
        assert (lane.calls, lane.board_reads) == (3, 1)  # a miss on the board asks the server
        tier = await _tier_stats_when(client, server, lambda t: t["board_reads"] == 1)
        assert tier["hit_pages"] == PAGES + 3  # the board read's Touch counted its pages
        # Every lease went back: a flush drops every page (a pinned one stays).
        assert (await client.admin_flush())[server.address]["dropped"] == PAGES
        assert await asyncio.to_thread(lane.read, KEYS, out) == 0


@pytest.mark.asyncio
async def test_a_server_gone_or_write_back_leaves_the_call_to_the_loop(servers):
    truth = _pages()
    async with _lanes(servers) as (server, client, local, (lane,)):
        await _meet(client, local)
        assert await asyncio.to_thread(lane.read, KEYS[:1], RunsCopier(truth.clone())) == 1
        back = dataclasses.replace(client.config, write_policy=WritePolicy.WRITE_BACK)
        client.config = back
        assert await asyncio.to_thread(lane.write, KEYS, RunsCopier(truth)) is None
        server.stop()
        start = time.monotonic()
        assert await asyncio.to_thread(lane.read, KEYS, RunsCopier(truth.clone())) is None
        # Off the lane for a while: the next call does not try the server again.
        assert await asyncio.to_thread(lane.read, KEYS, RunsCopier(truth.clone())) is None
        assert time.monotonic() - start < client.config.timeout_s
        assert lane.calls == 1


@pytest.mark.asyncio
async def test_a_board_read_whose_slots_change_under_it_asks_the_server(servers):
    truth = _pages()
    loop = asyncio.get_running_loop()
    async with _lanes(servers) as (server, client, local, (lane,)):
        await _meet(client, local)
        assert await asyncio.to_thread(lane.write, KEYS, RunsCopier(truth)) == PAGES - 1

        def flush() -> None:  # every slot withdrawn while the lane copies out of them
            asyncio.run_coroutine_threadsafe(client.admin_flush(), loop).result(10)

        out = RunsCopier(torch.zeros_like(truth), during=flush)
        # The copy's generations moved: the read goes to the server, which has nothing.
        assert await asyncio.to_thread(lane.read, KEYS, out) == 0
        assert lane.board_reads == 0
        tier = (await client.server_stats())[server.address]["tier"]
        assert tier["board_reads"] == 0 and tier["lookups"] == 1
        # Written again (new slots, new generations): read off the board, exact.
        assert await asyncio.to_thread(lane.write, KEYS, RunsCopier(truth)) == PAGES
        out = RunsCopier(torch.zeros_like(truth))
        assert await asyncio.to_thread(lane.read, KEYS, out) == PAGES
        assert torch.equal(out.pages, truth) and lane.board_reads == 1


@pytest.mark.asyncio
async def test_lanes_of_one_client_share_the_boards_and_report_reads_when_idle(
    servers, every_commit_posted
):
    truth = _pages()
    async with _lanes(servers, 2) as (server, client, local, (writes, reads)):
        await _meet(client, local)
        assert await asyncio.to_thread(writes.write, KEYS, RunsCopier(truth)) == PAGES - 1
        # The write's commit was posted; the other lane's read finds the pages
        # on the board (sealed), or takes the commit's answer and looks again.
        assert set(writes.share.unsettled) == {server.address}
        out = RunsCopier(torch.zeros_like(truth))
        # The write lane's answered call mapped the board: the first read asks no server.
        assert await asyncio.to_thread(reads.read, KEYS, out) == PAGES
        assert torch.equal(out.pages, truth) and reads.board_reads == 1
        # Nothing else is asked of the server: the reporter thread posts the read.
        tier = await _tier_stats_when(client, server, lambda t: t["board_reads"] == 1)
        assert tier["board_reads"] == 1 and tier["hit_pages"] == PAGES


@pytest.mark.asyncio
async def test_a_read_missing_the_clients_own_write_takes_its_commits_answer_first(
    servers, every_commit_posted
):
    truth = _pages()
    async with _lanes(servers, 2) as (server, client, local, (writes, reads)):
        await _meet(client, local)
        assert await asyncio.to_thread(writes._on_lane, server.address)
        channel = writes._channels[server.address]
        held, post, settle = [], channel.post, channel.settle

        def post_later(request, reply) -> bool:  # a server slow to read the commit
            if isinstance(request, Commit):
                held.append((request, reply))
                return True
            return post(request, reply)

        def settle_now() -> None:
            while held:
                channel.call(*held.pop())
            settle()

        channel.post, channel.settle = post_later, settle_now
        assert await asyncio.to_thread(writes.write, KEYS, RunsCopier(truth)) == PAGES - 1
        assert held  # not sealed yet: the board has only the first page
        out = RunsCopier(torch.zeros_like(truth))
        assert await asyncio.to_thread(reads.read, KEYS, out) == PAGES
        assert torch.equal(out.pages, truth) and not held and reads.board_reads == 1
