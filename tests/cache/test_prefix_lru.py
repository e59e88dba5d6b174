"""prefix-lru, the default: the compiled policy against its reference call for
call; never below LRU, request by request on one server and in total on a
sharded tier, on small generated traces (one built to defeat a frequency
count among them); an ancestor of a page being written never goes."""

import argparse
import gc
import random
import weakref

import pytest
from kvrelay.cache.eviction._prefix_lru import PrefixLRU

from kvrelay.bench import cache as cache_bench
from kvrelay.bench.cache_tiers import close_tiers, make_tiers
from kvrelay.bench.cache_workloads import Shape, sessions_trace
from kvrelay.cache.eviction import DEFAULT_POLICY, POLICIES, EvictionPolicy, make_policy
from kvrelay.cache.eviction.compiled import CompiledPrefixLRUPolicy
from kvrelay.cache.eviction.prefix import PrefixLRUReference, reference_state
from kvrelay.cache.index import PageIndex
from kvrelay.layout.ring import HashRing
from kvrelay.transfer import create_agent
from tests.cache.test_eviction import chains, key, random_ops
from tests.cache.test_lirs_compiled import cache_ops, replay_victims


def test_the_default_is_compiled_prefix_lru():
    # A build that lost the module would fall back to the reference silently.
    assert DEFAULT_POLICY == "prefix-lru"
    assert POLICIES[DEFAULT_POLICY] is CompiledPrefixLRUPolicy
    assert isinstance(make_policy(), CompiledPrefixLRUPolicy)


def assert_same_run(ops, seed) -> None:
    reference, compiled = PrefixLRUReference(), CompiledPrefixLRUPolicy()
    for step, (method, args) in enumerate(ops):
        mine = getattr(compiled, method)(*args)
        theirs = getattr(reference, method)(*args)
        assert mine == theirs, (seed, step, method, args)
        assert compiled.debug_state() == reference_state(reference), (seed, step, method, args)
        assert len(compiled) == len(reference)
    assert list(compiled.evictable()) == list(reference.evictable())


def test_the_compiled_policy_matches_the_reference_call_for_call():
    for seed in range(40):
        assert_same_run(random_ops(random.Random(seed), 1500, 20 + 60 * (seed % 3)), seed)
    for seed in range(12):
        rng = random.Random(1000 + seed)
        assert_same_run(cache_ops(rng, 1500, 400, 4 + 8 * (seed % 3)), seed)


class EagerReference(PrefixLRUReference):
    guess_weight = 1  # the dead-page guess acts at once, so the runs reach it


def with_empty_lookups(ops, rng):
    """`ops` with lookups that hit nothing mixed in (they make the next pages cold)."""
    for op in ops:
        if rng.random() < 0.15:
            yield "touch_many", ([],)
        yield op


def test_the_dead_page_guess_matches_the_reference_call_for_call():
    reached = set()
    for seed in range(40):
        rng = random.Random(2000 + seed)
        if seed % 2:
            ops = random_ops(rng, 1500, 20 + 60 * (seed % 3))
        else:
            ops = cache_ops(rng, 1500, 400, 4 + 8 * (seed % 3))
        reference, compiled = EagerReference(), PrefixLRU(guess_weight=1)
        for step, (method, args) in enumerate(with_empty_lookups(ops, rng)):
            mine = getattr(compiled, method)(*args)
            theirs = getattr(reference, method)(*args)
            assert mine == theirs, (seed, step, method, args)
            assert compiled.debug_state() == reference_state(reference), (seed, step, method)
            right, wrong, _ = reference_state(reference)["counts"]
            reached |= {"early" if reference._early else "", "right" if right else "",
                        "wrong" if wrong else "", "guessing" if wrong < right else ""}  # fmt: skip
    assert {"early", "right", "wrong", "guessing"} <= reached


def test_an_index_replay_evicts_the_same_pages_in_the_same_order():
    rng = random.Random(5)
    prompt = [key(i) for i in range(8)]
    sessions = [prompt[:] for _ in range(12)]
    requests, n = [], 1000
    for _ in range(300):
        s = rng.randrange(len(sessions))
        sessions[s] += [key(n + i) for i in range(rng.randrange(1, 4))]
        n += 4
        requests.append(list(sessions[s]))
    for capacity in (16, 40, 120):
        mine = replay_victims(CompiledPrefixLRUPolicy(), requests, capacity)
        theirs = replay_victims(PrefixLRUReference(), requests, capacity)
        assert mine == theirs, capacity
        assert mine[0] and mine[1]


def test_bad_keys_and_arguments_are_refused():
    policy = CompiledPrefixLRUPolicy()
    with pytest.raises(TypeError):
        policy.admit(["unhashable"])
    with pytest.raises(TypeError):
        policy.touch_many([b"a", ["unhashable"]])
    with pytest.raises(TypeError):
        policy.admit(b"a", parent=None, sealed=True)
    with pytest.raises(TypeError):
        CompiledPrefixLRUPolicy(3)
    policy.admit(b"a", evictable=True)
    policy.admit(b"b", parent=b"a", evictable=True)
    assert b"a" in policy and len(policy) == 2
    assert policy.victim() == b"b" and policy.victim() == b"a" and policy.victim() is None


class Key:
    def __init__(self, n: int) -> None:
        self.n = n

    def __hash__(self) -> int:
        return hash(self.n)

    def __eq__(self, other) -> bool:
        return isinstance(other, Key) and other.n == self.n


def test_keys_are_released_when_they_leave():
    policy = CompiledPrefixLRUPolicy()
    keys = [Key(i) for i in range(200)]
    watch = [weakref.ref(k) for k in keys]
    for i, k in enumerate(keys):
        policy.admit(k, keys[i - 1] if i else None, True)
    for k in keys[100:]:
        policy.forget(k)
    del keys, k
    gc.collect()
    assert all(w() is None for w in watch[100:])
    assert all(w() is not None for w in watch[:100])
    del policy
    gc.collect()
    assert all(w() is None for w in watch)


def test_a_parent_that_left_and_returned_is_not_its_old_childs_parent():
    # The child was admitted under the page that left; the page of the same
    # key admitted later has no child, and is a leaf.
    for policy in (CompiledPrefixLRUPolicy(), PrefixLRUReference()):
        policy.admit(b"a", None, True)
        policy.admit(b"b", b"a", False)  # held: being written
        policy.forget(b"a")
        policy.admit(b"a", None, True)
        assert policy.victim() == b"a"


def test_an_ancestor_of_a_page_being_written_never_goes():
    index = PageIndex(16)
    (a,) = chains(index, 3)
    lease = index.pin([a[2]], lease_s=60)  # the tail is being read or written
    lone = key(99)
    index.insert(lone, 9, sealed=True)
    assert [v.key for v in index.evict(3)] == [lone]  # a[0] and a[1] stay
    # An owner with an L3 behind it may take them (least recently used first).
    assert [v.key for v in index.evict(1, inner=True)] == [a[0]]
    index.release(lease.lease_id)
    assert [v.key for v in index.evict(3)] == a[:0:-1]


# -- never below LRU ---------------------------------------------------------------


def per_request_hits(agent, requests, servers: int, capacity: int, policy: str) -> list[int]:
    """Each request's prefix hits replayed through real CacheTiers (as `bench
    cache` does: lookups, then reservations pinned while they are written)."""
    args = argparse.Namespace(block_tokens=512, page_bytes=1, trace="generated")
    key_lists = cache_bench._key_lists(args, requests)
    ring = HashRing([f"s{i}" for i in range(servers)])
    index = {name: i for i, name in enumerate(ring.servers)}

    def route(_n, k):
        return index[ring.server_for(k)]

    tiers = make_tiers(agent, servers, max(1, capacity // servers), 64, None, policy)
    hits = []
    for number in range(len(requests)):
        one = slice(number, number + 1)
        counts = cache_bench._replay_tiers(
            tiers, route, requests[one], key_lists[one], args, lambda n=1: None
        )
        hits.append(counts.hit_pages)
    close_tiers(tiers)
    return hits


SHAPES = {
    "sessions": Shape(sessions=12, turns=6, concurrent=3, system_pages=(4,), grow=2),
    # Chains longer than a server's share of the cache: writes run out of room.
    "long": Shape(sessions=4, turns=14, concurrent=2, system_pages=(6,), grow=3),
    "prompts": Shape(sessions=16, turns=3, concurrent=4, system_pages=(2, 5, 9), grow=1),
    "floods": Shape(sessions=10, turns=4, concurrent=2, flood=6, flood_pages=(1, 5)),
    "scan": Shape(sessions=10, turns=5, concurrent=3, scan_every=7, scan_pages=30),
}


def frequency_trap() -> list[dict]:
    """A trace built to defeat a frequency count: a few chains read many times
    early, then never again, while sessions cycle through a working set that
    fits only if those chains go."""
    hot = [[1000 + 10 * c + i for i in range(4)] for c in range(3)]
    requests = [chain for _ in range(12) for chain in hot]
    sessions = [[2000 + 100 * s + i for i in range(3)] for s in range(5)]
    for turn in range(8):
        for s, pages in enumerate(sessions):
            pages.append(2000 + 100 * s + 3 + turn)
            requests.append(list(pages))
    return [{"input_length": 512 * len(ids), "hash_ids": ids} for ids in requests]


@pytest.mark.asyncio
@pytest.mark.parametrize("shape", [*SHAPES, "frequency-trap"])
async def test_never_below_lru_request_by_request_on_one_server(shape):
    # On one server a lookup reads its chain parent first, so LRU and this
    # order differ only inside the pages one lookup read last; every page LRU
    # keeps with its whole prefix, this order keeps too.
    requests = frequency_trap() if shape == "frequency-trap" else sessions_trace(SHAPES[shape])
    agent = await create_agent("loopback", token="t", fast_path=False)
    pages = len({i for r in requests for i in r["hash_ids"]})
    try:
        for capacity in sorted({4, 9, pages // 10, pages // 4, pages // 2}):
            lru = per_request_hits(agent, requests, 1, capacity, "lru")
            mine = per_request_hits(agent, requests, 1, capacity, DEFAULT_POLICY)
            worse = [i for i, (a, b) in enumerate(zip(lru, mine, strict=True)) if b < a]
            assert not worse, (shape, capacity, worse[:5])
    finally:
        await agent.close()


class LFU(EvictionPolicy):
    """Least frequently read first (ties: least recently), for the trap's test."""

    name = "test-lfu"

    def __init__(self) -> None:
        self.reads: dict = {}
        self.held: set = set()
        self.clock = 0

    def admit(self, key, parent=None, evictable=False):
        self.clock += 1
        self.reads.setdefault(key, [0, self.clock])
        (self.held.discard if evictable else self.held.add)(key)

    def make_evictable(self, key):
        self.held.discard(key)

    def hold(self, key):
        if key in self.reads:
            self.held.add(key)

    def touch(self, key):
        self.clock += 1
        if key in self.reads:
            self.reads[key][0] += 1
            self.reads[key][1] = self.clock

    def forget(self, key):
        self.reads.pop(key, None)
        self.held.discard(key)

    def victim(self):
        free = [k for k in self.reads if k not in self.held]
        if not free:
            return None
        key = min(free, key=lambda k: self.reads[k])
        del self.reads[key]
        return key

    def evictable(self):
        return iter([k for k in self.reads if k not in self.held])

    def __len__(self):
        return len(self.reads)


@pytest.mark.asyncio
async def test_the_frequency_trap_defeats_a_frequency_policy(monkeypatch):
    # The trace does what it is built for: least frequently read first keeps
    # the dead hot chains and falls below LRU; the default does not.
    monkeypatch.setitem(POLICIES, LFU.name, LFU)
    agent = await create_agent("loopback", token="t", fast_path=False)
    try:
        requests = frequency_trap()
        lru = sum(per_request_hits(agent, requests, 1, 24, "lru"))
        lfu = sum(per_request_hits(agent, requests, 1, 24, LFU.name))
        mine = sum(per_request_hits(agent, requests, 1, 24, DEFAULT_POLICY))
        assert lfu < lru <= mine, (lfu, lru, mine)
    finally:
        await agent.close()


class NoGuess(PrefixLRUReference):
    name = "test-no-guess"
    guess_weight = 10**9


@pytest.mark.asyncio
@pytest.mark.parametrize("servers", [1, 2])
async def test_the_dead_page_guess_takes_one_off_prompts_first(monkeypatch, servers):
    # Floods of one-off prompts between sessions: once the guess has seen
    # pages written after lookups that hit nothing leave unread, such pages
    # go before the sessions' older pages.
    monkeypatch.setitem(POLICIES, NoGuess.name, NoGuess)
    shape = Shape(sessions=16, turns=4, concurrent=2, system_pages=(4,), grow=2, flood=12,
                  flood_pages=(2, 6))  # fmt: skip
    requests = sessions_trace(shape)
    agent = await create_agent("loopback", token="t", fast_path=False)
    try:
        lru, order, mine = (
            sum(per_request_hits(agent, requests, servers, 60, name))
            for name in ("lru", NoGuess.name, DEFAULT_POLICY)
        )
        assert lru < order < mine, (lru, order, mine)
    finally:
        await agent.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("servers", [2, 4])
async def test_never_below_lru_on_a_sharded_tier(servers):
    agent = await create_agent("loopback", token="t", fast_path=False)
    try:
        for name, shape in SHAPES.items():
            requests = sessions_trace(shape)
            pages = sum(len(r["hash_ids"]) for r in requests)
            for capacity in (8 * servers, 16 * servers, 40 * servers):
                lru = sum(per_request_hits(agent, requests, servers, capacity, "lru"))
                mine = sum(per_request_hits(agent, requests, servers, capacity, DEFAULT_POLICY))
                assert mine >= lru - 0.002 * pages, (name, capacity, mine, lru)
    finally:
        await agent.close()
