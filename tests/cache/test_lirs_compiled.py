"""The compiled prefix-LIRS against its reference: the same results and the
same state after every call, on random calls and on an index's replay; bad
keys refused; keys given back once the policy lets them go."""

import gc
import random
import weakref

import pytest

from kvrelay.cache.eviction import POLICIES, make_policy
from kvrelay.cache.eviction.compiled import CompiledPrefixLIRSPolicy, reference_state
from kvrelay.cache.eviction.lirs import PrefixLIRSReference
from kvrelay.cache.index import PageIndex
from tests.cache.test_eviction import key, random_ops


class CountingReference(PrefixLIRSReference):
    """The reference, counting which of its inner steps a run of calls reached."""

    def __init__(self) -> None:
        super().__init__()
        self.reached: set[str] = set()

    def victim(self):
        if not self._front and not self._queue:
            self.reached.add("victim after demoting" if self._lirs else "victim parked")
        elif self._front:
            self.reached.add("victim from the head")
        return super().victim()

    def _drop_ghosts(self):
        self.reached.add("drop ghosts")
        super()._drop_ghosts()

    def _split(self):
        self.reached.add("split")
        super()._split()

    def _demote_oldest(self):
        self.reached.add("demote")
        super()._demote_oldest()

    def _prune(self):
        if self._lirs and len(self._top) + len(self._tail) > len(self._resident):
            self.reached.add("prune")
        super()._prune()

    def _expire(self):
        lirs, finished_read = self._lirs, self._finished_read
        super()._expire()
        if self._lirs < lirs:
            self.reached.add("finished page")
            if self._finished_read == finished_read or self._lirs < lirs - 1:
                self.reached.add("finished with its lookup")

    def _move_split(self, pages):
        super()._move_split(pages)
        self.reached.add("split toward HIR" if pages > 0 else "split toward LIR")
        low, high = self.share_bounds
        if self._hir_now in (low, high):
            self.reached.add(f"share at {'low' if self._hir_now == low else 'high'} bound")


def cache_ops(rng: random.Random, steps: int, universe: int, capacity: int):
    """Calls as a cache makes them: chains read and written, a victim whenever
    more than `capacity` pages are resident (so ghosts pile up past what S keeps)."""
    resident = 0
    for _ in range(steps):
        start = rng.randrange(universe)
        chain = [start + i for i in range(rng.randrange(1, 6))]
        yield "touch_many", (chain[: rng.randrange(len(chain) + 1)],)
        parent = None
        for k in chain:
            yield "admit", (k, parent, rng.random() < 0.9)
            parent = k
            resident += 1
            while resident > capacity:
                yield "victim", ()
                resident -= 1
        if rng.random() < 0.05:
            yield "forget", (rng.randrange(universe),)


def assert_same_run(ops, seed) -> set[str]:
    reference, compiled = CountingReference(), CompiledPrefixLIRSPolicy()
    for step, (method, args) in enumerate(ops):
        mine = getattr(compiled, method)(*args)
        theirs = getattr(reference, method)(*args)
        assert mine == theirs, (seed, step, method, args)
        assert compiled.debug_state() == reference_state(reference), (seed, step, method, args)
    assert len(compiled) == len(reference)
    assert list(compiled.evictable()) == list(reference.evictable())
    return reference.reached


def test_the_compiled_policy_matches_the_reference_call_for_call():
    reached: set[str] = set()
    for seed in range(60):
        rng = random.Random(seed)
        reached |= assert_same_run(random_ops(rng, 1500, 20 + 60 * (seed % 3)), seed)
    for seed in range(12):
        rng = random.Random(1000 + seed)
        reached |= assert_same_run(cache_ops(rng, 1500, 400, 4 + 8 * (seed % 3)), seed)
    # The runs reach every step of LIRS's bookkeeping and of what it learns
    # (lirs_adapt.py), so each one was compared.
    assert reached == {
        "victim after demoting",
        "victim parked",
        "victim from the head",
        "drop ghosts",
        "split",
        "demote",
        "prune",
        "finished page",
        "finished with its lookup",
        "split toward HIR",
        "split toward LIR",
        "share at low bound",
        "share at high bound",
    }


def replay_victims(policy, requests: list[list[bytes]], capacity: int) -> tuple[list, int]:
    """A cache's calls through the real index: lookups, a victim per page over
    capacity, chains inserted under their parents. (victims, hits)."""
    index = PageIndex(1, policy=policy)
    victims, hits = [], 0
    for keys in requests:
        found = index.lookup(keys).hits
        hits += found
        parent = keys[found - 1] if found else None
        for k in keys[found:]:
            if k not in index:
                if len(index) >= capacity:
                    victims += [v.key for v in index.evict(1)]
                index.insert(k, 0, sealed=True, parent=parent if parent in index else None)
            parent = k
    return victims, hits


def test_an_index_replay_evicts_the_same_pages_in_the_same_order():
    # Sessions sharing a prompt and growing turn by turn, more than the cache holds.
    rng = random.Random(3)
    prompt = [key(i) for i in range(8)]
    sessions = [prompt[:] for _ in range(12)]
    requests, n = [], 1000
    for _ in range(300):
        s = rng.randrange(len(sessions))
        sessions[s] += [key(n + i) for i in range(rng.randrange(1, 4))]
        n += 4
        requests.append(list(sessions[s]))
    for capacity in (16, 40, 120):
        mine = replay_victims(CompiledPrefixLIRSPolicy(), requests, capacity)
        theirs = replay_victims(PrefixLIRSReference(), requests, capacity)
        assert mine == theirs, capacity
        assert mine[0] and mine[1]


def test_prefix_lirs_is_the_compiled_policy():
    # A build that lost the module would fall back to the reference silently.
    assert POLICIES["prefix-lirs"] is CompiledPrefixLIRSPolicy
    assert isinstance(make_policy("prefix-lirs"), CompiledPrefixLIRSPolicy)


def test_bad_keys_and_arguments_are_refused():
    policy = CompiledPrefixLIRSPolicy()
    with pytest.raises(TypeError):
        policy.admit(["unhashable"])
    with pytest.raises(TypeError):
        policy.touch_many([b"a", ["unhashable"]])
    with pytest.raises(TypeError):
        policy.touch_many(5)
    with pytest.raises(TypeError):
        policy.admit(b"a", parent=None, sealed=True)
    with pytest.raises(TypeError):
        policy.admit()
    policy.admit(b"a", evictable=True)
    policy.admit(b"b", parent=b"a", evictable=True)
    assert b"a" in policy and len(policy) == 2
    assert policy.victim() == b"b" and policy.victim() == b"a" and policy.victim() is None


class Key:
    """A key that can be watched for release."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __hash__(self) -> int:
        return hash(self.n)

    def __eq__(self, other) -> bool:
        return isinstance(other, Key) and other.n == self.n


def test_keys_are_released_when_the_policy_lets_them_go():
    policy = CompiledPrefixLIRSPolicy()
    keys = [Key(i) for i in range(200)]
    watch = [weakref.ref(k) for k in keys]
    for i, k in enumerate(keys):
        policy.admit(k, keys[i - 1] if i else None, True)
    policy.touch_many(keys[:50])
    for k in keys[100:]:
        policy.forget(k)
    del keys, k
    gc.collect()
    # Forgotten pages leave S too, and no child counts under them: their keys go.
    assert all(w() is None for w in watch[100:])
    assert all(w() is not None for w in watch[:100])
    del policy
    gc.collect()
    assert all(w() is None for w in watch)
