"""`kvrelay bench cache`: replay a Mooncake-format trace through the cache tier.

Each trace line has `hash_ids`; a hash id stands for one block of
`--block-tokens` (512) tokens whose content is deterministic per id, and its
page key is the key chain of kvrelay.layout over those tokens (one page per
block). Requests go round robin to `--workers` simulated prefill workers.
Per L2 capacity (total pages), three policies side by side:

- `infinite`: every page ever written stays (the optimum);
- `local`: each worker has its own CacheTier of capacity / workers pages;
- `shared`: `--servers` CacheTiers, pages placed by HashRing, the same total.

A request looks up its keys (longest sealed prefix, as a worker would) and
writes the pages it missed. The tiers are the real CacheTier (index, arena
slots, LRU); page bytes are not copied, since hit rates do not depend on
them, and the arenas use tiny slots. Bytes moved are counted at
`--page-bytes` per page. No L3 in this replay yet.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import struct
from pathlib import Path

from kvrelay.bench.stats import format_table, machine_info, write_json
from kvrelay.cache.arena import ArenaConfig, PageArena
from kvrelay.cache.ring import HashRing
from kvrelay.cache.tier import CacheTier
from kvrelay.transfer import create_agent

SLOT_BYTES = 64  # arena slot size in the replay; hit rates do not depend on it
NAMESPACE = hashlib.sha256(b"kvrelay bench cache").digest()


def load_trace(path: str | Path, limit: int | None = None) -> list[dict]:
    requests = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                requests.append(json.loads(line))
                if limit is not None and len(requests) >= limit:
                    break
    return requests


class KeyChain:
    """Page keys of hash-id sequences: sha256 over the parent key and the block's tokens."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._keys: dict[tuple[bytes, int], bytes] = {}

    def tokens(self, hash_id: int) -> bytes:
        # Deterministic per hash id, distinct between ids: uint32 LE as in layout.
        base = hash_id * self.block_tokens
        return struct.pack(f"<{self.block_tokens}I", *range(base, base + self.block_tokens))

    def keys(self, hash_ids: list[int]) -> list[bytes]:
        parent = NAMESPACE
        out = []
        for hash_id in hash_ids:
            memo = (parent, hash_id)
            key = self._keys.get(memo)
            if key is None:
                key = hashlib.sha256(parent + self.tokens(hash_id)).digest()
                self._keys[memo] = key
            out.append(key)
            parent = key
        return out


class Counts:
    __slots__ = ("bytes_in", "bytes_out", "hit_pages", "hit_tokens", "pages", "tokens")

    def __init__(self) -> None:
        self.pages = self.hit_pages = self.tokens = self.hit_tokens = 0
        self.bytes_in = self.bytes_out = 0

    def add(self, pages: int, hits: int, input_tokens: int, block_tokens: int, page_bytes: int):
        self.pages += pages
        self.hit_pages += hits
        self.tokens += input_tokens
        self.hit_tokens += min(hits * block_tokens, input_tokens)
        self.bytes_in += hits * page_bytes
        self.bytes_out += (pages - hits) * page_bytes

    def to_json(self) -> dict:
        return {
            "block_hit_rate": self.hit_pages / max(self.pages, 1),
            "token_hit_rate": self.hit_tokens / max(self.tokens, 1),
            "bytes_pulled": self.bytes_in,
            "bytes_written": self.bytes_out,
        }


def _replay_tiers(tiers: list[CacheTier], route, requests, key_lists, args, progress) -> Counts:
    counts = Counts()
    for number, (request, keys) in enumerate(zip(requests, key_lists, strict=True)):
        groups: dict[int, list[int]] = {}
        for position, key in enumerate(keys):
            groups.setdefault(route(number, key), []).append(position)
        # Global prefix: up to the first key its tier does not hold sealed.
        found = {t: tiers[t].lookup([keys[p] for p in ps]).hits for t, ps in groups.items()}
        taken = dict.fromkeys(groups, 0)
        hits = 0
        for key in keys:
            tier = route(number, key)
            if taken[tier] >= found[tier]:
                break
            taken[tier] += 1
            hits += 1
        for key in keys[hits:]:
            tier = tiers[route(number, key)]
            slots, lease = tier.reserve([key], lease_s=60)
            if slots[0] is not None:
                tier.commit(key, [(0, SLOT_BYTES)])
            tier.release(lease.lease_id)
        counts.add(len(keys), hits, request["input_length"], args.block_tokens, args.page_bytes)
        progress()
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


async def _tiers(agent, count: int, pages_each: int) -> list[CacheTier]:
    return [
        CacheTier(PageArena(agent, ArenaConfig(SLOT_BYTES, capacity_pages=pages_each)))
        for _ in range(count)
    ]


async def _run(args: argparse.Namespace) -> dict:
    requests = load_trace(args.trace, args.limit)
    chain = KeyChain(args.block_tokens)
    key_lists = [chain.keys(r["hash_ids"]) for r in requests]
    unique = len({k for keys in key_lists for k in keys})
    capacities = [int(c) for c in args.capacities.split(",")] if args.capacities else None
    if not capacities:
        capacities = [max(args.workers, int(unique * f)) for f in (0.05, 0.1, 0.25, 0.5, 1.0)]
    bar = _progress_bar(len(requests) * (1 + 2 * len(capacities)), args.no_progress)
    agent = await create_agent("loopback", token="bench-cache", fast_path=False)
    results = {"infinite": _replay_infinite(requests, key_lists, args, bar.update).to_json()}
    rows = []
    ring = HashRing([f"server-{i}" for i in range(args.servers)])
    server_of = {name: i for i, name in enumerate(ring.servers)}
    results["capacities"] = []
    for capacity in capacities:
        local = await _tiers(agent, args.workers, max(1, capacity // args.workers))
        local_counts = _replay_tiers(
            local, lambda n, _k: n % args.workers, requests, key_lists, args, bar.update
        )
        shared = await _tiers(agent, args.servers, max(1, capacity // args.servers))
        shared_counts = _replay_tiers(
            shared, lambda _n, k: server_of[ring.server_for(k)], requests, key_lists, args,
            bar.update,
        )  # fmt: skip
        for tier in local + shared:
            tier.arena.close(force=True)
        entry = {
            "capacity_pages": capacity,
            "capacity_bytes": capacity * args.page_bytes,
            "local": local_counts.to_json(),
            "shared": shared_counts.to_json(),
        }
        results["capacities"].append(entry)
        rows.append(_row(entry, results["infinite"]))
    bar.close()
    await agent.close()
    payload = {
        "bench": "cache",
        "trace": str(args.trace),
        "requests": len(requests),
        "unique_pages": unique,
        "workers": args.workers,
        "servers": args.servers,
        "block_tokens": args.block_tokens,
        "page_bytes": args.page_bytes,
        "machine": machine_info(),
        **results,
    }
    print(
        format_table(
            [
                "pages",
                "GiB",
                "infinite",
                "local",
                "shared",
                "shared/inf",
                "shared tok",
                "pulled GiB",
            ],
            rows,
        )
    )
    return payload


def _row(entry: dict, infinite: dict) -> list:
    inf = infinite["block_hit_rate"]
    shared = entry["shared"]
    return [
        entry["capacity_pages"],
        f"{entry['capacity_bytes'] / (1 << 30):.1f}",
        f"{inf:.3f}",
        f"{entry['local']['block_hit_rate']:.3f}",
        f"{shared['block_hit_rate']:.3f}",
        f"{shared['block_hit_rate'] / inf:.3f}" if inf else "-",
        f"{shared['token_hit_rate']:.3f}",
        f"{shared['bytes_pulled'] / (1 << 30):.1f}",
    ]


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int, disabled: bool):
    if disabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="replay", unit="req", mininterval=0.5)


def plot(payload: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    caps = [e["capacity_pages"] for e in payload["capacities"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.axhline(payload["infinite"]["block_hit_rate"], color="k", ls="--", label="infinite")
    for policy in ("shared", "local"):
        count = payload["servers" if policy == "shared" else "workers"]
        rates = [e[policy]["block_hit_rate"] for e in payload["capacities"]]
        ax.plot(caps, rates, "o-", label=f"{policy} ({count})")
    ax.set_xscale("log")
    ax.set_xlabel("L2 capacity (pages, total)")
    ax.set_ylabel("block hit rate")
    ax.set_ylim(0, 1)
    ax.legend()
    ax.set_title(f"{Path(payload['trace']).name}: {payload['requests']} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, help="Mooncake-format JSONL")
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--capacities", default="", help="total pages, comma-separated")
    parser.add_argument("--block-tokens", type=int, default=512)
    parser.add_argument(
        "--page-bytes", type=int, default=64 << 20, help="bytes of one page (for bytes moved)"
    )
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--plot", metavar="PNG", help="plot hit rate vs capacity here")
    parser.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> dict:
    payload = asyncio.run(_run(args))
    if args.json:
        write_json(args.json, payload)
    if args.plot:
        plot(payload, args.plot)
    return payload
