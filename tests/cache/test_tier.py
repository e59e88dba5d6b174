"""CacheTier over a real registered arena (loopback agent) and a real file L3."""

import hashlib

import pytest
import torch

from kvrelay.cache.arena import ArenaConfig, PageArena
from kvrelay.cache.l3 import open_store
from kvrelay.cache.tier import CacheTier, TierConfig
from kvrelay.layout import ParallelConfig, page_writers
from kvrelay.transfer import create_agent
from tests.cache.specs import SPEC

PAGE = SPEC.page_bytes
NS = SPEC.namespace()
KEYS = SPEC.page_keys(list(range(SPEC.page_size * 8)))


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def content(i: int) -> bytes:
    return hashlib.shake_128(i.to_bytes(4, "little")).digest(PAGE)


async def make_tier(tmp_path, slots: int, l3: bool = True, clock=None, **config):
    agent = await create_agent("loopback", token="t")
    arena = PageArena(agent, ArenaConfig(PAGE, capacity_pages=slots))
    store = open_store(f"file:{tmp_path / 'l3'}", capacity_bytes=1 << 20) if l3 else None
    kw = {"clock": clock} if clock else {}
    return agent, CacheTier(arena, store, TierConfig(**config), **kw)


def fill(tier: CacheTier, i: int, namespace: bytes = b"") -> None:
    """Reserve page i, write it as two TP=2 writers would, and commit both rectangles."""
    slots, lease = tier.reserve([KEYS[i]], lease_s=30, namespace=namespace)
    view = tier.arena.view(slots[0])
    for _, rect in page_writers(SPEC, ParallelConfig(tp=2), 0):
        runs = rect.byte_runs(SPEC)
        for offset, length in runs:
            view[offset : offset + length] = content(i)[offset : offset + length]
        tier.commit(KEYS[i], runs)
    tier.release(lease.lease_id)


def test_arena_config_and_slots():
    with pytest.raises(ValueError):
        ArenaConfig(PAGE).num_slots()
    with pytest.raises(ValueError):
        ArenaConfig(PAGE, capacity_bytes=PAGE - 1).num_slots()
    assert ArenaConfig(PAGE, capacity_bytes=3 * PAGE + 5).num_slots() == 3


@pytest.mark.asyncio
async def test_writers_fill_through_handles_and_reader_pulls_sealed_pages(tmp_path):
    async def main():
        agent, tier = await make_tier(tmp_path, slots=4, l3=False)
        writer = await create_agent("loopback", token="t")
        local = writer.allocate_arena(PAGE)
        slots, lease = tier.reserve(KEYS[:2], lease_s=30)
        assert slots == [0, 1]
        # Two TP x PP writer groups push their rectangles of page 0 one-sided.
        for config in (ParallelConfig(tp=2, pp=2), ParallelConfig(tp=4)):
            for _, rect in page_writers(SPEC, config, 0):
                runs = rect.byte_runs(SPEC)
                local.tensor.copy_(torch.frombuffer(bytearray(content(0)), dtype=torch.uint8))
                handle = agent.publish(tier.arena.arena, tier.arena.slot_runs([slots[0]], runs), NS)
                await writer.write(handle, local, [o for o, _ in runs], namespace=NS)
                tier.commit(KEYS[0], runs)
        assert tier.lookup(KEYS[:2]).slots == [0]  # page 1 reserved, never written
        assert tier.reserve(KEYS[:1], lease_s=30)[0] == [None]  # already sealed
        tier.release(lease.lease_id)
        hit = tier.lookup(KEYS[:3], lease_s=30)
        handle = agent.publish(
            tier.arena.arena, tier.arena.slot_runs([hit.slots[0]], [(0, PAGE)]), NS
        )
        reader = await create_agent("loopback", token="t")
        dest = reader.allocate_arena(PAGE)
        await reader.read(handle, dest, [0], namespace=NS)
        assert bytes(dest.buffer(0, PAGE)) == content(0)
        for a in (agent, writer, reader):
            await a.close()

    await main()


@pytest.mark.asyncio
async def test_eviction_demotes_to_l3_and_lookup_promotes_back(tmp_path):
    async def main():
        agent, tier = await make_tier(tmp_path, slots=3)
        for i in range(6):
            fill(tier, i)
        assert tier.stats.evictions == 3 and tier.stats.demotions == 3
        assert len(tier.l3) == 3  # pages 0..2 went down
        hit = tier.lookup(KEYS[:6], lease_s=30)
        # 0..2 come back from L3, evicting 3..5 (demoted in turn); only 3 slots.
        assert hit.hits == 3 and tier.stats.promotions == 3
        assert [bytes(tier.arena.view(s)) for s in hit.slots] == [content(i) for i in range(3)]
        tier.release(hit.lease.lease_id)
        assert tier.lookup(KEYS[3:6]).hits == 3  # promoted again in their turn
        # Evicting 0..2 now writes nothing: L3 holds the bytes they came from.
        assert tier.stats.demotions == 6 and tier.stats.clean_evictions == 3
        assert tier.lookup(KEYS[:3]).hits == 3  # and they are still there
        assert [bytes(tier.arena.view(e.slot)) for e in tier.lookup(KEYS[:3]).entries] == [
            content(i) for i in range(3)
        ]
        await agent.close()

    await main()


@pytest.mark.asyncio
async def test_write_through_puts_on_seal(tmp_path):
    async def main():
        agent, tier = await make_tier(tmp_path, slots=3, l3_policy="write-through")
        fill(tier, 0)
        assert tier.l3.get(KEYS[0]) == content(0)
        assert tier.stats.demotions == 0
        await agent.close()

    await main()


@pytest.mark.asyncio
async def test_corrupt_l3_page_ends_the_promoted_run(tmp_path):
    async def main():
        agent, tier = await make_tier(tmp_path, slots=2)
        for i in range(4):
            fill(tier, i)  # 0 and 1 demoted
        path = tier.l3._path(KEYS[1])
        path.write_bytes(path.read_bytes()[:-1] + b"?")
        assert tier.lookup(KEYS[:4]).hits == 1
        assert tier.l3.stats.checksum_failures == 1 and KEYS[1] not in tier.l3
        await agent.close()

    await main()


@pytest.mark.asyncio
async def test_full_arena_refuses_then_reclaims_abandoned_reservations(tmp_path):
    async def main():
        clock = FakeClock()
        agent, tier = await make_tier(tmp_path, slots=2, l3=False, clock=clock)
        slots, _ = tier.reserve(KEYS[:2], lease_s=5)  # a writer that dies
        assert slots == [0, 1]
        assert tier.reserve(KEYS[2:3], lease_s=5)[0] == [None]
        assert tier.stats.no_room == 1
        clock.now = 6
        assert tier.reserve(KEYS[2:3], lease_s=5)[0] != [None]
        assert KEYS[0] not in tier.index or KEYS[1] not in tier.index
        await agent.close()

    await main()


@pytest.mark.asyncio
async def test_flush_drops_unpinned_pages(tmp_path):
    async def main():
        agent, tier = await make_tier(tmp_path, slots=3, l3=False)
        fill(tier, 0)
        fill(tier, 1)
        hit = tier.lookup(KEYS[1:2], lease_s=30)
        assert tier.flush() == (1, 0)
        assert tier.lookup(KEYS[:1]).hits == 0 and tier.lookup(KEYS[1:2]).hits == 1
        assert tier.arena.free_slots == 2
        tier.release(hit.lease.lease_id)
        await agent.close()

    await main()


@pytest.mark.asyncio
async def test_demote_all_writes_sealed_pages_back(tmp_path):
    async def main():
        agent, tier = await make_tier(tmp_path, slots=4)
        fill(tier, 0)
        fill(tier, 1)
        tier.reserve(KEYS[2:3], lease_s=30)  # unsealed: not demoted
        assert len(tier.l3) == 0
        assert tier.demote_all() == 2
        assert tier.l3.get(KEYS[1]) == content(1) and KEYS[2] not in tier.l3
        await agent.close()

    await main()


@pytest.mark.asyncio
async def test_flush_one_namespace_drops_its_pages_from_l2_and_l3(tmp_path):
    async def main():
        agent, tier = await make_tier(tmp_path, slots=6, l3_policy="write-through")
        other = hashlib.sha256(b"tenant b").digest()
        fill(tier, 0)  # fill() reserves without a namespace
        for i in (1, 2):
            _, lease = tier.reserve([KEYS[i]], lease_s=30, namespace=NS)
            tier.commit(KEYS[i], [(0, PAGE)])
            tier.release(lease.lease_id)
        _, lease = tier.reserve([KEYS[3]], lease_s=30, namespace=other)
        tier.commit(KEYS[3], [(0, PAGE)])
        tier.release(lease.lease_id)
        held = tier.lookup(KEYS[2:3], lease_s=30)  # pinned: survives the flush
        # L3 held the written-through copies of 1 and 2 (pinned 2 loses its copy).
        assert tier.flush(NS) == (1, 2)
        assert KEYS[1] not in tier.index and KEYS[1] not in tier.l3
        assert all(k in tier.index for k in (KEYS[0], KEYS[2], KEYS[3]))
        assert KEYS[3] in tier.l3 and tier.index.get(KEYS[3]).namespace == other
        tier.release(held.lease.lease_id)
        assert tier.flush(NS) == (1, 0) and tier.flush() == (2, 2) and len(tier.index) == 0
        assert len(tier.l3) == 0
        assert tier.arena.free_slots == 6
        await agent.close()

    await main()


@pytest.mark.asyncio
async def test_l3_pages_are_found_in_their_own_namespace_only(tmp_path):
    async def main():
        agent, tier = await make_tier(tmp_path, slots=1)
        fill(tier, 0, namespace=NS)
        fill(tier, 1, namespace=NS)  # 0 demoted, filed under NS
        other = hashlib.sha256(b"tenant b").digest()
        assert tier.lookup(KEYS[:1], namespace=other).hits == 0
        assert tier.lookup(KEYS[:1]).hits == 0
        assert tier.lookup(KEYS[:1], namespace=NS).hits == 1
        assert tier.index.get(KEYS[0]).namespace == NS
        await agent.close()

    await main()


@pytest.mark.asyncio
async def test_flush_reaches_pages_only_l3_holds(tmp_path):
    async def main():
        agent, tier = await make_tier(tmp_path, slots=2)
        other = hashlib.sha256(b"tenant b").digest()
        for i in range(4):
            fill(tier, i, namespace=NS)
        for i in range(4, 8):
            fill(tier, i, namespace=other)
        # L2 holds 6 and 7; L3 holds 0..5 (4 and 5 demoted when 6 and 7 came).
        assert tier.stats.demotions == 6 and len(tier.l3) == 6
        assert tier.flush(NS) == (0, 4)
        assert len(tier.l3) == 2 and all(KEYS[i] in tier.l3 for i in (4, 5))
        assert tier.lookup(KEYS[:4], namespace=NS).hits == 0
        # Promoted back, demoting 6 and 7: L2 holds 4 and 5, L3 holds 4..7.
        assert tier.lookup(KEYS[4:6], namespace=other).hits == 2
        assert tier.flush(other) == (2, 4) and len(tier.l3) == 0
        await agent.close()

    await main()


@pytest.mark.asyncio
async def test_a_page_of_the_run_demoted_to_make_room_is_promoted_back(tmp_path):
    """A prefix whose middle page L2 holds, least recently used, and whose
    other pages are in L3: making room for the first promoted page demotes
    the middle one, which L3 was not asked for; the run fetches it again."""
    agent, tier = await make_tier(tmp_path, slots=3, eviction="lru")
    for i in (1, 5, 6):  # page 1 is the least recently used
        fill(tier, i)
    for i in (0, 2):
        assert tier.l3.put(KEYS[i], content(i))
    result = tier.lookup(KEYS[:3])
    assert result.hits == 3 and tier.stats.promotions == 3 and tier.stats.demotions == 3
    pages = [bytes(tier.arena.view(e.slot)) for e in result.entries]
    assert pages == [content(i) for i in range(3)]
    await agent.close()


@pytest.mark.asyncio
async def test_promotion_walks_past_pages_l2_already_holds(tmp_path):
    """A server that gains keys (a ring change) holds some pages of a prefix in
    L2 and finds the others in L3: one lookup answers the whole prefix."""
    agent, tier = await make_tier(tmp_path, slots=8)
    for i in (1, 3):
        fill(tier, i)
    for i in (0, 2, 4):
        assert tier.l3.put(KEYS[i], content(i))
    result = tier.lookup(KEYS[:6])
    assert result.hits == 5 and tier.stats.promotions == 3
    pages = [bytes(tier.arena.view(e.slot)) for e in result.entries]
    assert pages == [content(i) for i in range(5)]
    await agent.close()


@pytest.mark.asyncio
async def test_a_chain_longer_than_l2_is_answered_in_turns(tmp_path):
    """L2 holds 4 pages and L3 the chain's 8: a lookup answers the 4 that fit,
    pinned, and says more may follow; released, the next lookup from page 4
    brings up the rest. A chain that ends in L3 says nothing more."""
    agent, tier = await make_tier(tmp_path, slots=4)
    for i in range(8):
        assert tier.l3.put(KEYS[i], content(i))
    first = tier.lookup(KEYS[:8], lease_s=30)
    assert (first.hits, first.more) == (4, True)
    assert [bytes(tier.arena.view(e.slot)) for e in first.entries] == [content(i) for i in range(4)]
    tier.release(first.lease.lease_id)
    second = tier.lookup(KEYS[4:8], lease_s=30)
    assert (second.hits, second.more) == (4, False)
    assert [bytes(tier.arena.view(e.slot)) for e in second.entries] == [
        content(i) for i in range(4, 8)
    ]
    tier.release(second.lease.lease_id)
    tier.l3.flush()
    for i in (0, 1):
        assert tier.l3.put(KEYS[i], content(i))
    short = tier.lookup(KEYS[:8])
    assert (short.hits, short.more) == (2, False)
    await agent.close()


@pytest.mark.asyncio
async def test_a_lookup_at_its_promotion_cap_says_more_may_follow(tmp_path):
    agent, tier = await make_tier(tmp_path, slots=8, max_promote=3)
    fill(tier, 0)
    for i in range(1, 6):
        assert tier.l3.put(KEYS[i], content(i))
    first = tier.lookup(KEYS[:6])
    assert (first.hits, first.more) == (4, True)  # one L2 hit, three promoted
    rest = tier.lookup(KEYS[4:6])
    assert (rest.hits, rest.more) == (2, False)
    everything = tier.lookup(KEYS[:6])
    assert (everything.hits, everything.more) == (6, False)  # all in L2 now
    await agent.close()
