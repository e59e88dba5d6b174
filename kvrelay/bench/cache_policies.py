"""Eviction policies in `kvrelay bench cache`: Belady's bound and the
partial-foresight oracles on the same servers, and what each policy costs
the index per operation.

The cost is the real `PageIndex` under each policy, replaying the trace's
own stream of lookups and inserts at one capacity, the policies
interleaved round by round so that a noisy neighbour slows them alike;
the median of the rounds is reported. Beside the policies replayed for hit
rates, the cost table has the Python reference of each compiled one
(`prefix-lru-reference`, `prefix-lirs-reference`: the same choices).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Sequence

from kvrelay.bench.belady import belady_hits
from kvrelay.bench.oracles import oracle_hits
from kvrelay.cache.eviction import POLICIES, make_policy
from kvrelay.cache.eviction.lirs import PrefixLIRSReference
from kvrelay.cache.eviction.prefix import PrefixLRUReference
from kvrelay.cache.index import PageIndex


def offline_bounds(key_lists, capacities: Sequence[int], route, requests, args, counts_cls,
                   oracles=()):  # fmt: skip
    """Belady and the named partial-foresight oracles on `len(capacities)`
    servers, counted as the tier replays are: name -> `counts_cls()`."""
    replays = {"belady": belady_hits(key_lists, capacities, route)}
    for name in oracles:
        replays[name] = oracle_hits(key_lists, capacities, route, name)
    out = {}
    for name, hits in replays.items():
        counts = out[name] = counts_cls()
        for request, keys, hit in zip(requests, key_lists, hits, strict=True):
            counts.add(len(keys), hit, request["input_length"], args.block_tokens, args.page_bytes)
    return out


# Measured for their cost only: the references of the compiled policies
# (the same choices, so no hit rates of their own).
REFERENCES = {"prefix-lru-reference": PrefixLRUReference,
              "prefix-lirs-reference": PrefixLIRSReference}  # fmt: skip


def cost_names(names: Sequence[str]) -> list[str]:
    """`names`, then the reference of each compiled one among them."""
    refs = [f"{n}-reference" for n in names if f"{n}-reference" in REFERENCES]
    return [*names, *(r for r in refs if POLICIES[r[: -len("-reference")]] is not REFERENCES[r])]


def _make(name: str):
    return REFERENCES[name]() if name in REFERENCES else make_policy(name)


def _index_pass(name: str, key_lists, capacity: int) -> tuple[int, int, int, int]:
    """One replay through a PageIndex under `name`: (lookup ns, pages looked up,
    insert ns, inserts).

    A lookup's work grows with its hits (each is touched), and a better
    policy hits more, so lookups are counted per page they examined (the
    hits and the first miss). An insert is what a tier does for a missed
    page: evict one page when full, then index the page sealed, naming the
    key before it as parent.
    """
    index = PageIndex(1, policy=_make(name))
    clock = time.perf_counter_ns
    lookup_ns = insert_ns = lookups = inserts = 0
    for keys in key_lists:
        start = clock()
        hits = index.lookup(keys).hits
        lookup_ns += clock() - start
        lookups += min(hits + 1, len(keys))
        start = clock()
        parent = keys[hits - 1] if hits else None
        for key in keys[hits:]:
            if key not in index:
                if len(index) >= capacity:
                    index.evict(1)
                if parent is not None and parent not in index:
                    parent = None
                index.insert(key, 0, sealed=True, parent=parent)
                inserts += 1
            parent = key
        insert_ns += clock() - start
    return lookup_ns, lookups, insert_ns, inserts


def _summary(samples: list[tuple[float, float]]) -> dict:
    lookup = [s[0] for s in samples]
    insert = [s[1] for s in samples]
    return {
        "ns_per_lookup": statistics.median(lookup),
        "ns_per_lookup_min": min(lookup),
        "ns_per_lookup_max": max(lookup),
        "ns_per_insert": statistics.median(insert),
        "ns_per_insert_min": min(insert),
        "ns_per_insert_max": max(insert),
    }


def index_cost(key_lists, capacity: int, names: Sequence[str], rounds: int) -> dict:
    """ns per page looked up and per page inserted under each policy (median of
    `rounds`, with min and max), and each one's ratio to the first name's: the
    ratio of the medians, and the spread of the rounds' own ratios
    (`*_ratio_min`, `*_ratio_max`: each round against the first name's pass of
    the same round).

    Measured with Python's cyclic collector running, as in a cache server
    (its pauses land on whichever operation allocates, and a policy that
    keeps an object per page gives it more to scan), and again with it
    paused (`gc_off`): the policy's own work. Every other round runs the
    policies in the reverse order, so that neither goes first throughout.
    """
    samples = {(n, c): [] for n in names for c in (True, False)}
    for number in range(rounds):
        for name in names if number % 2 == 0 else names[::-1]:
            for collector in (True, False):
                gc.collect()
                if not collector:
                    gc.disable()
                try:
                    lookup_ns, lookups, insert_ns, inserts = _index_pass(name, key_lists, capacity)
                finally:
                    gc.enable()
                samples[name, collector].append(
                    (lookup_ns / max(lookups, 1), insert_ns / max(inserts, 1))
                )
    out: dict = {"capacity_pages": capacity, "rounds": rounds, "baseline": names[0]}
    for name in names:
        out[name] = _summary(samples[name, True])
        out[name]["gc_off"] = _summary(samples[name, False])
    for collector, group in ((True, lambda n: out[n]), (False, lambda n: out[n]["gc_off"])):
        base, base_rounds = group(names[0]), samples[names[0], collector]
        for name in names:
            mine = group(name)
            mine["lookup_ratio"] = mine["ns_per_lookup"] / base["ns_per_lookup"]
            mine["insert_ratio"] = mine["ns_per_insert"] / base["ns_per_insert"]
            for i, op in enumerate(("lookup", "insert")):
                mine_rounds = samples[name, collector]
                paired = [m[i] / b[i] for m, b in zip(mine_rounds, base_rounds, strict=True)]
                mine[f"{op}_ratio_min"], mine[f"{op}_ratio_max"] = min(paired), max(paired)
    return out


def gap_closed(policies: dict, name: str) -> float | None:
    """How much of the gap between LRU and Belady `name` closes (None: no gap)."""
    lru, best = policies["lru"]["block_hit_rate"], policies["belady"]["block_hit_rate"]
    if best - lru <= 1e-12:
        return None
    return (policies[name]["block_hit_rate"] - lru) / (best - lru)
