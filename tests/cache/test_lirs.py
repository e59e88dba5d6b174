"""prefix-lirs: what LIRS keeps (loops, one-off tails, a shared prompt), the
prefix rule on returning parents, its batched reads against the plain loop,
and its bounded state."""

import random

import pytest

from kvrelay.cache.eviction import make_policy
from kvrelay.cache.eviction.compiled import CompiledPrefixLIRSPolicy, reference_state
from kvrelay.cache.eviction.lirs import _LIR, PrefixLIRSReference
from kvrelay.cache.index import PageIndex
from tests.cache.test_eviction import chains, key, random_ops


def loop_hits(name: str, pages: int, capacity: int, rounds: int) -> int:
    index = PageIndex(16, policy=make_policy(name))
    hits = 0
    for _ in range(rounds):
        for i in range(pages):
            if index.lookup([key(i)]).hits:
                hits += 1
                continue
            if len(index) >= capacity:
                index.evict(1)
            index.insert(key(i), i, sealed=True)
    return hits


def test_lirs_keeps_part_of_a_loop_larger_than_the_cache():
    assert loop_hits("lru", 10, 8, 20) == 0
    assert loop_hits("prefix-lirs", 10, 8, 20) >= 19 * 4


def test_pages_read_once_leave_in_arrival_order():
    index = PageIndex(16, policy=make_policy("prefix-lirs"))
    for i in range(6):
        index.insert(key(i), i, sealed=True)
    assert [v.key for v in index.evict(6)] == [key(i) for i in range(6)]


def test_a_one_off_tail_leaves_before_a_shared_prompt_read_by_every_request():
    # A prompt read by three requests, then a one-off request that reads it and
    # writes two pages of its own: they are the newest, yet they go first.
    for name, first_out in (("prefix-lirs", "tail"), ("lru", "prompt")):
        index = PageIndex(16, policy=make_policy(name))
        (prompt,) = chains(index, 4)
        for _ in range(3):
            assert index.lookup(prompt).hits == 4
        tail = [key(100), key(101)]
        assert index.lookup(prompt + tail).hits == 4
        index.insert(tail[0], 100, sealed=True, parent=prompt[-1])
        index.insert(tail[1], 101, sealed=True, parent=tail[0])
        gone = [v.key for v in index.evict(2)]
        assert gone == (tail[::-1] if first_out == "tail" else prompt[:2]), name


def test_a_returning_parent_is_kept_for_the_child_that_stayed():
    # A parent that had to go while its child was pinned, and comes back (the
    # same key is the same prefix), stays while that child does.
    index = PageIndex(16, policy=make_policy("prefix-lirs"))
    parent, child, lone = key(0), key(1), key(2)
    index.insert(parent, 0, sealed=True)
    index.insert(child, 1, sealed=True, parent=parent)
    lease = index.pin([child], lease_s=60)
    assert [v.key for v in index.evict(1)] == [parent]  # nothing else could go
    index.insert(parent, 0, sealed=True)
    index.release(lease.lease_id)
    index.insert(lone, 2, sealed=True)
    order = [v.key for v in index.evict(3)]
    assert order.index(child) < order.index(parent)


class SpelledOutReads(PrefixLIRSReference):
    """prefix-lirs with its reads as the plain loop: every key looked up in S,
    and S shortened after the batch if its oldest LIR page was among them."""

    def _read(self, keys):
        top = self._top
        if self._lirs:
            self._split()
        oldest = next(iter(top), None)
        shorten = False
        for k in keys:
            code = top.get(k)
            if code == _LIR:
                top.move_to_end(k)
                shorten = shorten or k == oldest
            else:
                self._read_hir(k, code)
        if shorten:
            self._prune()


def test_lirs_batched_reads_match_the_loop_spelled_out():
    # Batches shorter and longer than S, LIR pages only or mixed with others.
    for seed in range(40):
        fast, plain = PrefixLIRSReference(), SpelledOutReads()
        for method, args in random_ops(random.Random(seed), 2000, 20 + 100 * (seed % 3)):
            assert getattr(fast, method)(*args) == getattr(plain, method)(*args), seed
            assert list(fast._top.items()) == list(plain._top.items()), seed
            assert list(fast._tail.items()) == list(plain._tail.items()), seed


def test_lirs_queues_a_parent_at_the_front_when_its_last_child_leaves():
    # Chains of one-off pages leave tail first, each parent right after its
    # child; a pinned parent waits and then queues at Q's tail.
    index = PageIndex(16, policy=make_policy("prefix-lirs"))
    a, b = chains(index, 3, 3)
    assert [v.key for v in index.evict(3)] == a[::-1]
    lease = index.pin([b[1]], lease_s=60)
    lone = key(50)
    index.insert(lone, 50, sealed=True)
    assert [v.key for v in index.evict(2)] == [b[2], lone]  # b[1] is pinned
    index.release(lease.lease_id)
    assert [v.key for v in index.evict(2)] == [b[1], b[0]]


@pytest.mark.parametrize("policy_cls", [PrefixLIRSReference, CompiledPrefixLIRSPolicy])
def test_the_policy_state_stays_bounded(policy_cls):
    # S keeps ghosts of evicted pages: at most a fixed multiple of the resident pages.
    policy = policy_cls()
    index = PageIndex(16, policy=policy)
    rng = random.Random(7)
    for _ in range(20000):
        k = key(rng.randrange(5000))
        if not index.lookup([k]).hits:
            if len(index) >= 50:
                index.evict(1)
            index.insert(k, 0, sealed=True)
    compiled = policy_cls is CompiledPrefixLIRSPolicy
    state = policy.debug_state() if compiled else reference_state(policy)
    entries = len(state["top"]) + len(state["tail"])
    assert entries <= (2 + policy.ghost_factor) * len(index) + 1
    assert len(state["children"]) <= len(index)


def read_x_then_y(index: PageIndex, x: list[bytes], y: list[bytes], between=()) -> None:
    """X read four times (its last page only in the last of them, so that page
    has one reuse interval: too few to judge it by), then the pages `between`
    admitted, then only Y read, long enough for X to be taken for finished."""
    for _ in range(3):
        assert index.lookup(x).hits == 2
    x.append(key(99))
    index.insert(x[2], 99, sealed=True, parent=x[1])
    assert index.lookup(x).hits == 3
    for number, page in enumerate(between):
        index.insert(page, 100 + number, sealed=True)
    for _ in range(12):
        assert index.lookup(y).hits == 3


@pytest.mark.parametrize("policy_cls", [PrefixLIRSReference, CompiledPrefixLIRSPolicy])
def test_a_finished_prefix_leaves_whole_and_before_newer_pages(policy_cls):
    # X's oldest page, unread for longer than its intervals, is finished, and
    # so is every page its last lookup read with it: X leaves whole, deepest
    # page first, before the one-off pages that came after its last read.
    # (Judged page by page, X's last page would stay LIR, holding its parents
    # parked.)
    index = PageIndex(16, policy=policy_cls())
    x, y = chains(index, 2, 3)
    read_x_then_y(index, x, y, between=[key(100 + i) for i in range(10)])
    assert [v.key for v in index.evict(3)] == x[::-1]
    assert index.lookup(y).hits == 3


@pytest.mark.parametrize("policy_cls", [PrefixLIRSReference, CompiledPrefixLIRSPolicy])
def test_a_finished_prefix_waits_behind_pages_read_before_it(policy_cls):
    # The same X, but the one-off pages came before its reads: each is older
    # than X's last read, so they go first, in arrival order, as LRU would
    # take them; a page taken for finished may be a live session's.
    index = PageIndex(16, policy=policy_cls())
    x, y, *ones = chains(index, 2, 3, *[1] * 10)
    read_x_then_y(index, x, y)
    assert [v.key for v in index.evict(10)] == [one[0] for one in ones]
    assert [v.key for v in index.evict(3)] == x[::-1]
    assert index.lookup(y).hits == 3


def lookups_until_taken_for_finished(policy_cls, y_pages: int) -> int:
    """Chain Y of `y_pages` pages read in two lookups, then chain X, four
    times; then Y alone: the lookups of Y after X's last read until X's
    first page is taken for finished."""
    policy = policy_cls()
    index = PageIndex(16, policy=policy)
    x, y, *_ = chains(index, 2, y_pages, *[1] * 20)  # one-off pages: room for LIR pages
    for _ in range(4):
        for _ in range(2):
            assert index.lookup(y).hits == y_pages
        assert index.lookup(x).hits == 2
    state_of = reference_state if policy_cls is PrefixLIRSReference else type(policy).debug_state
    for n in range(1, 50):
        assert index.lookup(y).hits == y_pages
        state = state_of(policy)
        if x[0] in state["parked"] or x[0] in state["front"]:
            return n
    raise AssertionError("X was never taken for finished")


@pytest.mark.parametrize("policy_cls", [PrefixLIRSReference, CompiledPrefixLIRSPolicy])
def test_the_finished_test_counts_lookups_not_pages(policy_cls):
    # Two servers that answer the same lookups but hold different shares of
    # Y's chain judge X finished at the same lookup: its reads were three
    # lookups apart, so it is finished once unread for more than
    # stale_factor x 3 of them. (Counted in pages, the server holding more
    # of Y would judge X sooner: the servers would disagree about a session.)
    expected = int(policy_cls.stale_factor * 3) + 1
    assert lookups_until_taken_for_finished(policy_cls, 1) == expected
    assert lookups_until_taken_for_finished(policy_cls, 6) == expected
