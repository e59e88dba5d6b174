"""`kvrelay bench cache`: replay a Mooncake-format trace through the cache tier.

Each trace line has `hash_ids`; a hash id stands for one block of
`--block-tokens` (512) tokens whose content is deterministic per id, and its
page key is the key chain of kvrelay.layout over those tokens (one page per
full block: a partial last block, as `input_length` tells, is no page, since
kvrelay caches full pages only). Requests go round robin to `--workers`
simulated prefill workers.
Per L2 capacity (total pages), side by side:

- `infinite`: every page ever written stays (the optimum);
- `local`: each worker has its own CacheTier of capacity / workers pages
  (default eviction policy);
- `policies`: the host tier alone, `--servers` CacheTiers with pages placed
  by HashRing, the same total, under each eviction policy (`--policies`,
  all by default; `lru` and the default always), and Belady's offline bound on the same
  servers (`kvrelay.bench.belady`, the same prefix rule for hits);
  `shared` is the default policy's entry; beside them the partial-foresight
  oracles (`kvrelay.bench.oracles`): LRU knowing which pages will
  be read again, and eviction knowing how many reads each page has left;
- `policies_l3`: the same with an L3 behind each tier (`--l3`: a file store
  per server in a temp dir, `--l3-pages` in total split evenly, by default
  each server's share of the working set, the pages the ring places on it;
  or one valkey server): evicted pages are demoted
  (write-back), L2 misses found in L3 are promoted; Belady there is the
  bound of one cache of L2 and L3 together; `shared_l3` is the default's.

The index's cost per operation under each policy is measured after the
replays (`cache_policies.index_cost`), at the smallest capacity below the
working set.

A request looks up its keys (longest sealed prefix, as a worker would) and
writes the pages it missed, each tier its share in chain order as a client
does. The tiers are the real CacheTier (index, eviction policy, arena
slots, L3 stores). Pages are `--slot-bytes` long (small, for speed;
hit rates do not depend on it) with content fixed per key, written into the
slot on commit, moved for real through L3 on demotion and promotion, and
compared with the key's content on every hit: a wrong page fails the run, a
corrupt L3 record is a checksum failure and a miss. Bytes moved are counted
at `--page-bytes` per page.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from kvrelay.bench import cache_policies
from kvrelay.bench.arg_types import at_least, ints_at_least
from kvrelay.bench.cache_report import plot, print_tables, progress_bar
from kvrelay.bench.cache_sweep import run_sweep
from kvrelay.bench.cache_tiers import (
    L3_URLS,
    Counts,
    close_tiers,
    l3_dir,
    l3_stores,
    make_tiers,
    ring_shares,
)
from kvrelay.bench.cache_trace import (
    NAMESPACE,
    KeyChain,
    full_block_ids,
    load_trace,
    page_content,
)
from kvrelay.bench.cache_workloads import help_text, workload_names
from kvrelay.bench.oracles import ORACLES
from kvrelay.bench.stats import machine_info, write_json
from kvrelay.cache.eviction import DEFAULT_POLICY, POLICIES
from kvrelay.cache.l3.local_server import local_l3
from kvrelay.cache.tier import CacheTier
from kvrelay.layout.ring import HashRing
from kvrelay.transfer import create_agent


def _lookup_round(
    tiers: list[CacheTier], route, number: int, keys, counts: Counts
) -> tuple[int, bool]:
    """One lookup of `keys` on their tiers, as a client makes it: the global
    prefix found and whether the tier that ended it may hold more."""
    slot_bytes = tiers[0].arena.page_bytes
    groups: dict[int, list[int]] = {}
    for position, key in enumerate(keys):
        groups.setdefault(route(number, key), []).append(position)
    found, in_l2 = {}, {}
    for t, positions in groups.items():
        mine = [keys[p] for p in positions]
        # Leading pages resident before the lookup; the rest of its hits are promoted.
        in_l2[t] = next((i for i, k in enumerate(mine) if k not in tiers[t].index), len(mine))
        found[t] = tiers[t].lookup(mine, namespace=NAMESPACE)
    # Global prefix: up to the first key its tier does not hold sealed.
    taken = dict.fromkeys(groups, 0)
    hits, wrong = 0, False
    for key in keys:
        t = route(number, key)
        if taken[t] >= found[t].hits:
            break
        # What a reader would pull: the page must be this key's bytes.
        if tiers[t].arena.view(found[t].entries[taken[t]].slot) != page_content(key, slot_bytes):
            counts.wrong_pages += 1
            wrong = True
            break
        taken[t] += 1
        hits += 1
    for t, count in taken.items():
        counts.l2_hit_pages += min(count, in_l2[t])
        counts.l3_hit_pages += max(0, count - in_l2[t])
    more = not wrong and hits < len(keys) and found[route(number, keys[hits])].more
    return hits, more


def _replay_tiers(tiers: list[CacheTier], route, requests, key_lists, args, progress) -> Counts:
    counts = Counts()
    slot_bytes = tiers[0].arena.page_bytes
    for number, (request, keys) in enumerate(zip(requests, key_lists, strict=True)):
        hits = 0
        # Rounds while a tier answers part of its share and has more (see CacheClient.lookup).
        while hits < len(keys):
            got, more = _lookup_round(tiers, route, number, keys[hits:], counts)
            hits += got
            if not (got and more):
                break
        # Write what missed, each tier its share in chain order, as a client does.
        writes: dict[int, list[bytes]] = {}
        for key in keys[hits:]:
            writes.setdefault(route(number, key), []).append(key)
        for t, mine in writes.items():
            tier = tiers[t]
            while mine:  # in turns while the tier refuses pages for room it can make
                slots, lease = tier.reserve(mine, lease_s=60, namespace=NAMESPACE)
                for key, slot in zip(mine, slots, strict=True):
                    if slot is not None:
                        tier.arena.view(slot)[:] = page_content(key, slot_bytes)
                        tier.commit(key, [(0, slot_bytes)])
                more = tier.refused_for_room(mine, slots)
                tier.release(lease.lease_id)
                if not more or all(slot is None for slot in slots):
                    break
                mine = [k for k, slot in zip(mine, slots, strict=True) if slot is None]
        counts.add(len(keys), hits, request["input_length"], args.block_tokens, args.page_bytes)
        progress()
    counts.add_tiers(tiers)
    return counts


def _replay_infinite(requests, key_lists, args, progress) -> Counts:
    seen: set[bytes] = set()
    counts = Counts()
    for request, keys in zip(requests, key_lists, strict=True):
        hits = 0
        while hits < len(keys) and keys[hits] in seen:
            hits += 1
        seen.update(keys)
        counts.add(len(keys), hits, request["input_length"], args.block_tokens, args.page_bytes)
        progress()
    return counts


def _key_lists(args: argparse.Namespace, requests: list[dict]) -> list[list[bytes]]:
    """Per request, the page keys of its full blocks; SystemExit naming the
    request if its ids are not its prompt's blocks."""
    chain = KeyChain(args.block_tokens)
    out = []
    for number, request in enumerate(requests, 1):
        try:
            out.append(chain.keys(full_block_ids(request, args.block_tokens)))
        except ValueError as e:
            raise SystemExit(f"bench cache: {args.trace}, request {number}: {e}") from None
    return out


def _policy_names(args: argparse.Namespace) -> list[str]:
    """The online policies to replay: `lru` first (the baseline), the default among them."""
    names = [n for n in args.policies.split(",") if n]
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise SystemExit(f"bench cache: unknown policies {unknown}; known: {sorted(POLICIES)}")
    return list(dict.fromkeys(["lru", DEFAULT_POLICY, *names]))


def _capacities(args: argparse.Namespace, unique: int) -> list[int]:
    """`--capacities`, or 5 % to 100 % of the trace's distinct pages."""
    if args.capacities:
        return list(args.capacities)
    return [max(args.workers, int(unique * f)) for f in (0.05, 0.1, 0.25, 0.5, 1.0)]


async def _run(args: argparse.Namespace, requests: list[dict]) -> dict:
    """Long because the replays share the trace, the ring and the agent as closures."""
    key_lists = _key_lists(args, requests)
    distinct = {k for keys in key_lists for k in keys}
    unique = len(distinct)
    capacities = _capacities(args, unique)
    names = _policy_names(args)
    with_l3 = args.l3 != "none"
    runs_each = (1 + len(names) * (2 if with_l3 else 1)) * len(capacities)
    bar = progress_bar(len(requests) * (1 + runs_each), args.no_progress)
    agent = await create_agent("loopback", token="bench-cache", fast_path=False)
    page_bytes = args.page_bytes
    results = {"infinite": _replay_infinite(requests, key_lists, args, bar.update).to_json(0)}
    ring = HashRing([f"server-{i}" for i in range(args.servers)])
    server_of = {name: i for i, name in enumerate(ring.servers)}
    l3_pages = (args.l3_pages or unique) if with_l3 else 0

    def by_worker(n, _k):
        return n % args.workers

    def by_ring(_n, k):
        return server_of[ring.server_for(k)]

    shares = ring_shares(distinct, by_ring, args.servers)

    def replay(count, route, stores, capacity, eviction):
        each = max(1, capacity // count)
        tiers = make_tiers(agent, count, each, args.slot_bytes, stores, eviction)
        counts = _replay_tiers(tiers, route, requests, key_lists, args, bar.update)
        close_tiers(tiers)
        return counts.to_json(page_bytes)

    def bounds(capacity, oracles=()):
        each = [max(1, capacity // args.servers)] * args.servers
        found = cache_policies.offline_bounds(
            key_lists, each, by_ring, requests, args, Counts, oracles
        )
        return {name: counts.to_json(page_bytes) for name, counts in found.items()}

    results["capacities"] = []
    with tempfile.TemporaryDirectory(prefix="kvrelay-bench-l3-", dir=l3_dir(args)) as scratch:
        for run, capacity in enumerate(capacities):
            entry = {"capacity_pages": capacity, "capacity_bytes": capacity * page_bytes}
            entry["local"] = replay(args.workers, by_worker, None, capacity, DEFAULT_POLICY)
            entry["policies"] = bounds(capacity, ORACLES)
            for name in names:
                entry["policies"][name] = replay(args.servers, by_ring, None, capacity, name)
            entry["shared"] = entry["policies"][DEFAULT_POLICY]
            if with_l3:
                # Belady over L2 and L3 together: the bound of a cache of both sizes.
                entry["policies_l3"] = bounds(capacity + l3_pages)
                for number, name in enumerate(names):
                    stores = l3_stores(args, Path(scratch), shares, run, number)
                    entry["policies_l3"][name] = replay(
                        args.servers, by_ring, stores, capacity, name
                    )
                entry["shared_l3"] = entry["policies_l3"][DEFAULT_POLICY]
            results["capacities"].append(entry)
    bar.close()
    await agent.close()
    below = [c for c in capacities if c < unique] or capacities[:1]
    results["index_cost"] = cache_policies.index_cost(
        key_lists, below[0], cache_policies.cost_names(names), args.cost_rounds
    )
    return _report(args, requests, unique, l3_pages, names, results)


def _report(args: argparse.Namespace, requests, unique: int, l3_pages: int, names, results):
    """Prints the tables, returns the JSON payload; SystemExit if any hit
    page had the wrong bytes."""
    payload = {
        "bench": "cache",
        "trace": str(args.trace),
        "requests": len(requests),
        "unique_pages": unique,
        "default_policy": DEFAULT_POLICY,
        "online_policies": names,
        "oracles": list(ORACLES),
        "workers": args.workers,
        "servers": args.servers,
        "block_tokens": args.block_tokens,
        "page_bytes": args.page_bytes,
        "slot_bytes": args.slot_bytes,
        "l3": args.l3,
        "l3_pages": l3_pages,
        "machine": machine_info(),
        **results,
    }
    for entry in payload["capacities"]:
        entry["gap_closed"] = {
            name: cache_policies.gap_closed(entry["policies"], name) for name in [*names, *ORACLES]
        }
    print_tables(payload)
    wrong = _wrong_pages(payload)
    if wrong:
        raise SystemExit(f"bench cache: {wrong} hit pages had the wrong bytes")
    return payload


def _wrong_pages(payload: dict) -> int:
    wrong = 0
    for entry in payload["capacities"]:
        wrong += entry["local"]["wrong_pages"]
        for group in ("policies", "policies_l3"):
            wrong += sum(c["wrong_pages"] for c in entry.get(group, {}).values())
    return wrong


def _l3(text: str) -> str:
    """`--l3`: one of the forms its help names."""
    if text in ("file", "none", "valkey-cluster") or (
        text.startswith(L3_URLS) and text.split("://", 1)[1]
    ):
        return text
    raise argparse.ArgumentTypeError(
        f"must be file, none, valkey-cluster or a {'/'.join(L3_URLS)} URL, got {text!r}"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", help="Mooncake-format JSONL")
    parser.add_argument("--workloads", type=_workloads, default=None, help=help_text())
    positive = at_least(1)
    parser.add_argument("--limit", type=positive, default=None, help="replay only the first N")
    parser.add_argument("--workers", type=positive, default=8)
    parser.add_argument(
        "--servers", type=ints_at_least(1), default=[4],
        help="cache servers of the host tier; several (comma-separated), or --workloads,"
        " report every policy against LRU per workload, server count and capacity",
    )  # fmt: skip
    parser.add_argument(
        "--capacities", type=ints_at_least(1), default=None,
        help="total pages, comma-separated (default: 5, 10, 25, 50 and 100 %% of the"
        " trace's distinct pages)",
    )  # fmt: skip
    parser.add_argument("--block-tokens", type=positive, default=512)
    parser.add_argument(
        "--page-bytes", type=positive, default=64 << 20, help="bytes of one page (for bytes moved)"
    )
    parser.add_argument(
        "--l3", type=_l3, default="file",
        help="L3 of the shared tier: file (per-server stores in a temp dir), valkey://HOST:PORT"
        " (one shared server), valkey-cluster://HOST:PORT[,...] (a cluster; valkey-cluster"
        " alone starts a local one of 3 primaries + 3 replicas), or none",
    )  # fmt: skip
    parser.add_argument(
        "--l3-pages", type=positive, default=None,
        help="total file L3 capacity in pages, split evenly (default: each server "
        "the distinct pages the ring places on it)",
    )  # fmt: skip
    parser.add_argument(
        "--l3-dir", default=None, help="directory for the file L3 stores (default: /dev/shm)"
    )
    parser.add_argument(
        "--slot-bytes", type=positive, default=256,
        help="bytes of a page in the replay (L2 slots, L3 records); hit rates do not depend on it",
    )  # fmt: skip
    parser.add_argument(
        "--policies", default=",".join(POLICIES),
        help="eviction policies to replay, comma-separated (default: all; lru and the"
        f" default, {DEFAULT_POLICY}, always run); Belady's bound is computed besides",
    )  # fmt: skip
    parser.add_argument(
        "--cost-rounds", type=positive, default=3,
        help="rounds of the index cost measurement (median reported)",
    )  # fmt: skip
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--plot", metavar="PNG", help="plot hit rate vs capacity here")
    parser.add_argument("--no-progress", action="store_true")


def _workloads(text: str) -> list[str]:
    try:
        return workload_names(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def run(args: argparse.Namespace) -> dict:
    if args.trace is None and not args.workloads:
        raise SystemExit("bench cache: give --trace, --workloads or both")
    requests = None
    if args.trace is not None:
        try:  # before any server starts
            requests = load_trace(args.trace, args.limit)
        except (OSError, ValueError) as e:
            raise SystemExit(f"bench cache: {args.trace}: {e}") from None
    names = _policy_names(args)
    with local_l3(args.l3) as url:
        args.l3 = url
        if args.workloads or len(args.servers) > 1:
            payload = run_sweep(args, requests, names, _replay_tiers, _replay_infinite,
                                lambda r: _key_lists(args, r))  # fmt: skip
        else:
            args.servers = args.servers[0]
            payload = asyncio.run(_run(args, requests))
    if args.json:
        write_json(args.json, payload)
    if args.plot and "capacities" in payload:
        plot(payload, args.plot)
    return payload
