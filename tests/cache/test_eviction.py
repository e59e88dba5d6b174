"""Eviction policies: Belady's replay against brute force, the partial-foresight
oracles, pins and leases never victims, the prefix rule on hand-made chains,
LIRS against a loop."""

import argparse
import functools
import hashlib
import itertools
import random

import pytest

from kvrelay.bench.belady import belady_hits, next_uses
from kvrelay.bench.oracles import ORACLES, oracle_hits
from kvrelay.cache.eviction import DEFAULT_POLICY, POLICIES, make_policy
from kvrelay.cache.index import PageIndex
from kvrelay.cache.tier import TierConfig
from tests.cache.test_tier import make_tier

PREFIX_POLICIES = [name for name in POLICIES if name.startswith("prefix-")]


def key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest()


# -- Belady ------------------------------------------------------------------------


def random_chains(rng: random.Random, requests: int) -> list[list[tuple]]:
    """Requests reading paths from the root of a small binary tree: key lists
    whose keys name their whole prefix, as page keys do."""
    out = []
    for _ in range(requests):
        path = [("root", rng.randrange(2))]
        for _ in range(rng.randrange(0, 3)):
            path.append(path[-1] + (rng.randrange(2),))
        out.append(path)
    return out


def optimum(key_lists, capacity: int) -> int:
    """Brute force: the most prefix hits any choice of cache contents gets, the
    contents after each request being any `capacity` of what was cached or read."""

    @functools.cache
    def best(number: int, cached: frozenset) -> int:
        if number == len(key_lists):
            return 0
        keys = key_lists[number]
        hits = 0
        while hits < len(keys) and keys[hits] in cached:
            hits += 1
        pool = sorted(cached | set(keys))
        later = max(
            best(number + 1, frozenset(kept))
            for size in range(min(capacity, len(pool)) + 1)
            for kept in itertools.combinations(pool, size)
        )
        return hits + later

    return best(0, frozenset())


def test_belady_equals_the_brute_force_optimum_on_small_traces():
    rng = random.Random(7)
    for _ in range(120):
        key_lists = random_chains(rng, rng.randrange(2, 7))
        capacity = rng.randrange(1, 4)
        assert sum(belady_hits(key_lists, [capacity])) == optimum(key_lists, capacity)


def naive_belady(key_lists, capacities, route) -> list[int]:
    """Belady's rule spelled out: at each admission into a full cache, scan the
    rest of the trace for the resident key read farthest ahead (deeper on a tie)."""

    def next_read(key, after):
        for number in range(after + 1, len(key_lists)):
            if key in key_lists[number]:
                return number
        return len(key_lists)

    caches = [dict() for _ in capacities]  # key -> depth at its last read
    hits_out = []
    for number, keys in enumerate(key_lists):
        hits = 0
        while hits < len(keys) and keys[hits] in caches[route(number, keys[hits])]:
            hits += 1
        hits_out.append(hits)
        for depth, k in enumerate(keys):
            cache, capacity = caches[route(number, k)], capacities[route(number, k)]
            if k in cache or capacity == 0:
                cache.update({k: depth} if k in cache else {})
                continue
            if len(cache) >= capacity:
                rank = {c: (next_read(c, number), cache[c]) for c in cache}
                victim = max(rank, key=rank.get)
                if rank[victim] <= (next_read(k, number), depth):
                    continue
                del cache[victim]
            cache[k] = depth
    return hits_out


def test_sharded_belady_matches_the_rule_spelled_out():
    rng = random.Random(11)
    for _ in range(60):
        key_lists = random_chains(rng, rng.randrange(3, 12))
        capacities = [rng.randrange(0, 3), rng.randrange(1, 3)]

        def route(_number, k):
            return len(k) % 2

        assert belady_hits(key_lists, capacities, route) == naive_belady(
            key_lists, capacities, route
        )


def test_next_uses():
    assert next_uses([["a", "b"], ["b"], ["a"]]) == [[2, 1], [3], [3]]


def test_belady_hits_follow_the_prefix_rule():
    # b is cached but a is not: b does not hit.
    assert belady_hits([["b"], ["a", "b"]], [4]) == [0, 0]
    assert belady_hits([["a", "b"], ["a", "b"]], [4]) == [0, 2]


# -- partial-foresight oracles --------------------------------------------------------


def one_server(key_lists, capacity: int, name: str) -> list[int]:
    return oracle_hits(key_lists, [capacity], lambda _n, _k: 0, name)


def test_the_dead_page_oracle_admits_nothing_read_once():
    # c is never read again: LRU would evict a for it, the oracle keeps a and b.
    trace = [["a", "b"], ["c"], ["a", "b"]]
    assert one_server(trace, 2, "oracle-dead") == [0, 0, 2]
    # once its last read is past, a page goes first: x, read last, leaves for
    # z where LRU would evict y
    trace = [["x"], ["y"], ["y"], ["x"], ["z"], ["y"], ["z"]]
    assert one_server(trace, 2, "oracle-dead") == [0, 0, 1, 1, 0, 1, 1]


def test_the_read_count_oracle_keeps_what_is_read_most():
    # x has two reads left, y one: y is not admitted; the dead-page oracle,
    # blind to counts, keeps the newer y and misses x once more.
    trace = [["x"], ["y"], ["x"], ["x"], ["y"]]
    assert one_server(trace, 1, "oracle-count") == [0, 0, 1, 1, 0]
    assert one_server(trace, 1, "oracle-dead") == [0, 0, 0, 1, 0]


def test_the_oracles_follow_the_prefix_rule_and_never_beat_belady():
    for name in ORACLES:
        assert one_server([["b"], ["a", "b"], ["a", "b"]], 4, name) == [0, 0, 2]
    rng = random.Random(5)
    for _ in range(60):
        key_lists = random_chains(rng, rng.randrange(3, 10))
        capacity = rng.randrange(1, 4)
        best = optimum(key_lists, capacity)
        for name in ORACLES:
            assert sum(one_server(key_lists, capacity, name)) <= best
    with pytest.raises(ValueError, match="oracle must be"):
        one_server([["a"]], 1, "oracle-time")


# -- every policy: pins and leases ---------------------------------------------------


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_pinned_and_unsealed_pages_are_never_victims(name):
    rng = random.Random(name)
    index = PageIndex(16, policy=make_policy(name))
    leases: list[int] = []
    for step in range(3000):
        action = rng.random()
        k = key(rng.randrange(60))
        if action < 0.35 and k not in index:
            parent = key(rng.randrange(60))
            index.insert(
                k, 0, sealed=rng.random() < 0.8, parent=parent if parent in index else None
            )
        elif action < 0.5 and k in index:
            leases.append(index.pin([k], lease_s=100).lease_id)
        elif action < 0.6 and leases:
            index.release(leases.pop(rng.randrange(len(leases))))
        elif action < 0.75:
            found = index.lookup([k, key(rng.randrange(60))], lease_s=100)
            if found.lease is not None:
                if rng.random() < 0.2:
                    leases.append(found.lease.lease_id)
                else:
                    index.release(found.lease.lease_id)
        else:
            for victim in index.evict(rng.randrange(1, 4)):
                assert victim.pins == 0 and victim.sealed, (name, step)
                assert victim.key not in index
        assert len(index.policy) == len(index)
    # Once every lease is gone and the writers that never sealed are dropped,
    # every sealed page can go, and nothing else.
    for lease in leases:
        index.release(lease)
    index.drop_abandoned()
    sealed = {e.key for e in index.entries() if e.sealed}
    assert {v.key for v in index.evict(len(index))} == sealed


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_an_expired_lease_frees_its_pages(name):
    now = [0.0]
    index = PageIndex(16, clock=lambda: now[0], policy=make_policy(name))
    for i in range(3):
        index.insert(key(i), i, sealed=True, parent=key(i - 1) if i else None)
    index.lookup([key(0), key(1), key(2)], lease_s=5)
    assert index.evict(3) == []
    now[0] = 6.0
    assert len(index.evict(3)) == 3


def random_ops(rng: random.Random, steps: int, universe: int):
    """Calls on a policy, as (method, args): pages admitted under parents (held,
    or evictable at once), released, held, read in batches, forgotten, evicted
    (ancestors of held pages too)."""
    for _ in range(steps):
        action, k = rng.random(), rng.randrange(universe)
        if action < 0.3:
            parent = rng.choice([None, rng.randrange(universe)])
            yield "admit", (k, parent, rng.random() < 0.7)
        elif action < 0.45:
            yield "make_evictable", (k,)
        elif action < 0.52:
            yield "hold", (k,)
        elif action < 0.72:
            size = rng.choice([1, 2, 5, universe // 2])
            yield "touch_many", ([rng.randrange(universe) for _ in range(size)],)
        elif action < 0.76:
            yield "forget", (k,)
        elif action < 0.79:
            yield "victim_inner", ()
        else:
            yield "victim", ()


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_admitting_a_page_evictable_is_admitting_then_releasing_it(name):
    for seed in range(20):
        fused, split = make_policy(name), make_policy(name)
        for method, args in random_ops(random.Random(seed), 1500, 30 + 50 * (seed % 2)):
            if method == "admit":
                fused.admit(*args)
                split.admit(*args[:2])
                if args[2]:
                    split.make_evictable(args[0])
                continue
            assert getattr(fused, method)(*args) == getattr(split, method)(*args), (name, seed)
            assert len(fused) == len(split)
        assert sorted(fused.evictable()) == sorted(split.evictable())


# -- the prefix rule -----------------------------------------------------------------


def chains(index: PageIndex, *lengths: int) -> list[list[bytes]]:
    """Sealed chains of the given lengths, each page naming the one before it."""
    out, n = [], 0
    for length in lengths:
        keys = [key(n + i) for i in range(length)]
        for i, k in enumerate(keys):
            index.insert(k, n + i, sealed=True, parent=keys[i - 1] if i else None)
        out.append(keys)
        n += length
    return out


@pytest.mark.parametrize("name", PREFIX_POLICIES)
def test_a_page_goes_only_after_the_later_pages_of_its_chain(name):
    index = PageIndex(16, policy=make_policy(name))
    a, b = chains(index, 4, 3)
    # Read the chains, the heads more often than the tails.
    for _ in range(3):
        index.lookup(a[:2])
        index.lookup(b)
        index.lookup(a)
    order = [v.key for v in index.evict(len(index))]
    assert sorted(order) == sorted(a + b)
    for chain in (a, b):
        positions = [order.index(k) for k in chain]
        assert positions == sorted(positions, reverse=True), name  # tail first


def test_a_prefix_lirs_parent_goes_first_only_when_nothing_else_can():
    index = PageIndex(16, policy=make_policy("prefix-lirs"))
    (a,) = chains(index, 3)
    lease = index.pin([a[2]], lease_s=60)  # the tail is being read
    lone = key(99)
    index.insert(lone, 9, sealed=True)
    assert [v.key for v in index.evict(1)] == [lone]
    # Only a[0] and a[1] are left, both with a resident child: one must go.
    victims = [v.key for v in index.evict(2)]
    assert sorted(victims) == sorted(a[:2])
    index.release(lease.lease_id)
    assert [v.key for v in index.evict(1)] == [a[2]]


def test_prefix_lru_keeps_a_parent_read_after_its_child_in_recency_order():
    # In a sharded tier a lookup can read a server's page of a chain and stop
    # at another server's miss before reaching that server's next page: the
    # parent is then newer than its child and than pages read in between.
    index = PageIndex(16, policy=make_policy("prefix-lru"))
    a, b = chains(index, 2, 1)
    index.lookup(a[:1])  # a[0] is now the most recent page; a[1] the least
    victims = [v.key for v in index.evict(3)]
    assert victims == [a[1], b[0], a[0]]


def test_prefix_lru_is_least_recently_used_among_leaves():
    # Against the rule spelled out, over lookups, inserts and evictions: the
    # victim is the least recently read (or admitted) page with no resident
    # child; pages of one lookup share a time, and only its chain's last is a leaf.
    for seed in range(30):
        rng = random.Random(seed)
        index = PageIndex(64, policy=make_policy("prefix-lru"))
        last: dict[bytes, int] = {}
        parent_of: dict[bytes, bytes] = {}
        for clock in range(400):
            if rng.random() < 0.5 or not len(index):
                path = [(rng.randrange(6),)]
                for _ in range(rng.randrange(4)):
                    path.append(path[-1] + (rng.randrange(2),))
                keys = [hashlib.sha256(repr(p).encode()).digest() for p in path]
                hits = index.lookup(keys).hits
                for k in keys[:hits]:
                    last[k] = clock
                for i in range(hits, min(len(keys), hits + 64 - len(index))):
                    parent = keys[i - 1] if i else None
                    index.insert(keys[i], i, sealed=True, parent=parent)
                    last[keys[i]], parent_of[keys[i]] = clock, parent
                continue
            resident = {e.key for e in index.entries()}
            leaves = resident - {parent_of[k] for k in resident}
            (victim,) = [v.key for v in index.evict(1)]
            assert victim in leaves, seed
            assert last[victim] == min(last[k] for k in leaves), seed


def test_lru_ignores_chains():
    index = PageIndex(16, policy=make_policy("lru"))
    (a,) = chains(index, 3)
    assert [v.key for v in index.evict(3)] == a  # oldest first: the head


@pytest.mark.asyncio
async def test_the_tier_names_parents_from_reservations_and_lookups(tmp_path):
    # Through the index the tier builds: a chain reserved in two calls, the
    # second's first parent coming from the lookup that missed it.
    async def main():
        agent, tier = await make_tier(tmp_path, slots=8, l3=False)
        keys = [key(i) for i in range(5)]

        def write(chunk):
            _, lease = tier.reserve(chunk, lease_s=30)
            for k in chunk:
                tier.commit(k, [(0, tier.arena.page_bytes)])
            tier.release(lease.lease_id)

        write(keys[:2])
        assert tier.lookup(keys).hits == 2
        write(keys[2:])
        order = [v.key for v in tier.index.evict(5)]
        assert order == keys[::-1]
        await agent.close()

    await main()


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="eviction policy"):
        make_policy("fifo")
    with pytest.raises(ValueError, match="eviction policy"):
        TierConfig(eviction="fifo")


def test_the_cache_server_takes_its_eviction_policy_from_its_config():
    from kvrelay.cache.server import CacheServerConfig
    from kvrelay.options import add_arguments, from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser, CacheServerConfig)
    base = ["--token", "t", "--page-bytes", "64", "--arena-gb", "0.001"]
    assert from_args(CacheServerConfig, parser.parse_args(base)).eviction == DEFAULT_POLICY
    config = from_args(CacheServerConfig, parser.parse_args([*base, "--eviction", "lru"]))
    assert config.eviction == "lru"
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--eviction", "mru"])
