"""`kvrelay bench cache --workloads` (or several `--servers`): every policy
against LRU over many workloads, server counts and capacities.

Per workload (the generated ones of `cache_workloads`, and `--trace` if
given), server count and capacity (5 to 100 % of the workload's distinct
pages, or `--capacities`): the host tier's block hit rate under each online
policy, replayed through the real CacheTier as the single-trace report
does, its difference from LRU's, Belady's bound and `oracle-dead` (LRU that
knows which pages are dead) on the same servers, and how much of the
LRU-to-`oracle-dead` gap each policy closes. With an L3 (`--l3 file`, the
default) the default policy is replayed once more with a file L3 behind
each server, against the infinite cache. Last, the worst difference from
LRU of each policy over all rows, and where.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import tempfile
from pathlib import Path

from kvrelay.bench import cache_policies
from kvrelay.bench.cache_tiers import (
    Counts,
    close_tiers,
    l3_dir,
    l3_stores,
    make_tiers,
    ring_shares,
)
from kvrelay.bench.cache_workloads import WORKLOADS
from kvrelay.bench.stats import format_table, machine_info
from kvrelay.cache.eviction import DEFAULT_POLICY
from kvrelay.layout.ring import HashRing
from kvrelay.transfer import create_agent


def _rate(counts) -> float:
    return counts.hit_pages / max(counts.pages, 1)


def _closed(rate: float, lru: float, best: float) -> float | None:
    return None if best - lru <= 1e-12 else (rate - lru) / (best - lru)


async def _sweep(args, sources, names, replay_tiers, replay_infinite, key_lists_of) -> list[dict]:
    """Rows of the sweep; the replay functions are `cache.py`'s (passed in to
    avoid an import cycle)."""
    agent = await create_agent("loopback", token="bench-cache", fast_path=False)
    rows: list[dict] = []
    fresh = itertools.count()  # names each L3 store set's directories
    with tempfile.TemporaryDirectory(prefix="kvrelay-bench-l3-", dir=l3_dir(args)) as scratch:
        for label, requests in sources:
            key_lists = key_lists_of(requests)
            source = _Source(args, agent, requests, key_lists, replay_tiers, Path(scratch), fresh)
            infinite = _rate(replay_infinite(requests, key_lists, args, _nothing))
            capacities = list(args.capacities) if args.capacities else [
                max(1, int(source.unique * f)) for f in (0.05, 0.1, 0.25, 0.5, 1.0)
            ]  # fmt: skip
            for servers in args.servers:
                for run, capacity in enumerate(capacities):
                    row = source.row(names, servers, capacity, run)
                    rows.append({"workload": label, "infinite": infinite, **row})
    await agent.close()
    return rows


def _nothing(n: int = 1) -> None:
    pass


class _Source:
    """One workload's replays at a server count and capacity."""

    def __init__(self, args, agent, requests, key_lists, replay_tiers, scratch, fresh) -> None:
        self.args, self.agent, self.requests, self.key_lists = args, agent, requests, key_lists
        self.replay_tiers, self.scratch, self.fresh = replay_tiers, scratch, fresh
        self.distinct = {k for keys in key_lists for k in keys}
        self.unique = len(self.distinct)

    def row(self, names, servers: int, capacity: int, run: int) -> dict:
        args = self.args
        ring = HashRing([f"server-{i}" for i in range(servers)])
        index = {name: i for i, name in enumerate(ring.servers)}

        def route(_n, k):
            return index[ring.server_for(k)]

        each = max(1, capacity // servers)

        def replay(name, stores=None):
            tiers = make_tiers(self.agent, servers, each, args.slot_bytes, stores, name)
            found = self.replay_tiers(tiers, route, self.requests, self.key_lists, args, _nothing)
            close_tiers(tiers)
            return _rate(found)

        bounds = cache_policies.offline_bounds(
            self.key_lists, [each] * servers, route, self.requests, args, Counts, ("oracle-dead",)
        )
        row = {"servers": servers, "capacity_pages": capacity, "unique_pages": self.unique,
               "belady": _rate(bounds["belady"]), "oracle-dead": _rate(bounds["oracle-dead"]),
               "rates": {name: replay(name) for name in names}}  # fmt: skip
        if args.l3 != "none":
            shares = ring_shares(self.distinct, route, servers)
            stores = l3_stores(args, self.scratch, shares, run, next(self.fresh))
            row["default_l3"] = replay(DEFAULT_POLICY, stores)
        lru = row["rates"]["lru"]
        row["diff"] = {n: r - lru for n, r in row["rates"].items()}
        row["dead_gap_closed"] = {
            n: _closed(r, lru, row["oracle-dead"]) for n, r in row["rates"].items()
        }
        return row


def worst(rows: list[dict], names: list[str]) -> dict:
    """Per policy its lowest difference from LRU over `rows`, and where."""
    out = {}
    for name in names:
        row = min(rows, key=lambda r: r["diff"][name])
        out[name] = {"diff": row["diff"][name], "workload": row["workload"],
                     "servers": row["servers"], "pages": row["capacity_pages"]}  # fmt: skip
    return out


def print_sweep(rows: list[dict], names: list[str], summary: dict) -> None:
    others = [n for n in names if n != "lru"]
    headers = ["workload", "servers", "pages", "belady", "oracle-dead", "lru"]
    headers += [f"{n} (-lru)" for n in others] + [f"{DEFAULT_POLICY} dead gap"]
    if "default_l3" in rows[0]:
        headers.append(f"{DEFAULT_POLICY}+L3/inf")
    table = []
    for r in rows:
        line = [r["workload"], r["servers"], r["capacity_pages"], f"{r['belady']:.3f}",
                f"{r['oracle-dead']:.3f}", f"{r['rates']['lru']:.3f}"]  # fmt: skip
        line += [f"{r['rates'][n]:.3f} ({1000 * r['diff'][n]:+.1f}m)" for n in others]
        closed = r["dead_gap_closed"][DEFAULT_POLICY]
        line.append("-" if closed is None else f"{closed:.2f}")
        if "default_l3" in r:
            line.append(f"{r['default_l3'] / r['infinite']:.3f}" if r["infinite"] else "-")
        table.append(line)
    print(format_table(headers, table))
    print("\nworst difference from LRU (m: thousandths of block hit rate):")
    print(format_table(
        ["policy", "worst", "workload", "servers", "pages"],
        [[n, f"{1000 * w['diff']:+.1f}m", w["workload"], w["servers"], w["pages"]]
         for n, w in summary.items()],
    ))  # fmt: skip


def run_sweep(args: argparse.Namespace, trace_requests, names, replay_tiers, replay_infinite,
              key_lists_of) -> dict:  # fmt: skip
    sources = [(str(args.trace), trace_requests)] if trace_requests is not None else []
    sources += [(name, WORKLOADS[name][1]()) for name in args.workloads or ()]
    rows = asyncio.run(_sweep(args, sources, names, replay_tiers, replay_infinite, key_lists_of))
    summary = worst(rows, names)
    print_sweep(rows, names, summary)
    return {"bench": "cache-sweep", "default_policy": DEFAULT_POLICY, "online_policies": names,
            "servers": list(args.servers), "l3": args.l3, "rows": rows, "worst": summary,
            "machine": machine_info()}  # fmt: skip
