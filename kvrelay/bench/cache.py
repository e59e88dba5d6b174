"""`kvrelay bench cache`: replay a Mooncake-format trace through the cache tier.

Each trace line has `hash_ids`; a hash id stands for one block of
`--block-tokens` (512) tokens whose content is deterministic per id, and its
page key is the key chain of kvrelay.layout over those tokens (one page per
block). Requests go round robin to `--workers` simulated prefill workers.
Per L2 capacity (total pages), the policies side by side:

- `infinite`: every page ever written stays (the optimum);
- `local`: each worker has its own CacheTier of capacity / workers pages;
- `shared`: `--servers` CacheTiers, pages placed by HashRing, the same total;
- `shared_l3`: the same with an L3 behind each tier (`--l3`: a file store per
  server in a temp dir, `--l3-pages` in total, by default the whole working
  set; or one valkey server): evicted pages are demoted (write-back), L2
  misses found in L3 are promoted.

A request looks up its keys (longest sealed prefix, as a worker would) and
writes the pages it missed. The tiers are the real CacheTier (index, arena
slots, LRU, L3 stores). Pages are `--slot-bytes` long (small, for speed;
hit rates do not depend on it) with content fixed per key, written into the
slot on commit, moved for real through L3 on demotion and promotion, and
compared with the key's content on every hit: a wrong page fails the run, a
corrupt L3 record is a checksum failure and a miss. Bytes moved are counted
at `--page-bytes` per page.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path

from kvrelay.bench.cache_report import HEADERS, L3_HEADERS, l3_row, plot, progress_bar, row
from kvrelay.bench.stats import format_table, machine_info, write_json
from kvrelay.cache.arena import ArenaConfig, PageArena
from kvrelay.cache.l3 import L3Store, open_store, record
from kvrelay.cache.l3.local_server import local_l3
from kvrelay.cache.tier import CacheTier
from kvrelay.layout.ring import HashRing
from kvrelay.transfer import create_agent

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
    """One policy's replay: hits of the global prefix and bytes moved, per tier."""

    __slots__ = (
        "bytes_in", "bytes_out", "checksum_failures", "clean_evictions", "demotions",
        "hit_pages", "hit_tokens", "l2_hit_pages", "l3_bytes_in", "l3_bytes_out", "l3_hit_pages",
        "pages", "promotions", "tokens", "wrong_pages",
    )  # fmt: skip

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)

    def add(self, pages: int, hits: int, input_tokens: int, block_tokens: int, page_bytes: int):
        self.pages += pages
        self.hit_pages += hits
        self.tokens += input_tokens
        self.hit_tokens += min(hits * block_tokens, input_tokens)
        self.bytes_in += hits * page_bytes
        self.bytes_out += (pages - hits) * page_bytes

    def add_tiers(self, tiers: list[CacheTier]) -> None:
        """The tiers' own L3 counters (promotions also count pages past the prefix)."""
        for tier in tiers:
            self.promotions += tier.stats.promotions
            self.demotions += tier.stats.demotions
            self.clean_evictions += tier.stats.clean_evictions
            if tier.l3 is not None:
                self.l3_bytes_in += tier.l3.stats.bytes_in
                self.l3_bytes_out += tier.l3.stats.bytes_out
                self.checksum_failures += tier.l3.stats.checksum_failures

    def to_json(self, page_bytes: int) -> dict:
        return {
            "block_hit_rate": self.hit_pages / max(self.pages, 1),
            "token_hit_rate": self.hit_tokens / max(self.tokens, 1),
            "bytes_pulled": self.bytes_in,
            "bytes_written": self.bytes_out,
            "l2_hit_pages": self.l2_hit_pages,
            "l3_hit_pages": self.l3_hit_pages,  # prefix pages promoted from L3
            "l3_promotions": self.promotions,
            "l3_demotions": self.demotions,
            "l3_clean_evictions": self.clean_evictions,  # promoted pages: nothing to write
            # Counted at the nominal page size, like the L2 bytes ...
            "l3_bytes_demoted": self.demotions * page_bytes,
            "l3_bytes_promoted": self.promotions * page_bytes,
            # ... and the replay's slot bytes the store really moved.
            "l3_store_bytes_in": self.l3_bytes_in,
            "l3_store_bytes_out": self.l3_bytes_out,
            "l3_checksum_failures": self.checksum_failures,
            "wrong_pages": self.wrong_pages,
        }


def page_content(key: bytes, size: int) -> bytes:
    """A page's deterministic bytes in the replay: its key, repeated."""
    return (key * (size // len(key) + 1))[:size]


def _replay_tiers(tiers: list[CacheTier], route, requests, key_lists, args, progress) -> Counts:
    counts = Counts()
    slot_bytes = tiers[0].arena.page_bytes
    for number, (request, keys) in enumerate(zip(requests, key_lists, strict=True)):
        groups: dict[int, list[int]] = {}
        for position, key in enumerate(keys):
            groups.setdefault(route(number, key), []).append(position)
        found, in_l2 = {}, {}
        for t, positions in groups.items():
            mine = [keys[p] for p in positions]
            # Leading pages resident before the lookup; the rest of its hits are promoted.
            in_l2[t] = next((i for i, k in enumerate(mine) if k not in tiers[t].index), len(mine))
            found[t] = tiers[t].lookup(mine, namespace=NAMESPACE).entries
        # Global prefix: up to the first key its tier does not hold sealed.
        taken = dict.fromkeys(groups, 0)
        hits = 0
        for key in keys:
            t = route(number, key)
            if taken[t] >= len(found[t]):
                break
            # What a reader would pull: the page must be this key's bytes.
            if tiers[t].arena.view(found[t][taken[t]].slot) != page_content(key, slot_bytes):
                counts.wrong_pages += 1
                break
            taken[t] += 1
            hits += 1
        for t, count in taken.items():
            counts.l2_hit_pages += min(count, in_l2[t])
            counts.l3_hit_pages += max(0, count - in_l2[t])
        for key in keys[hits:]:
            tier = tiers[route(number, key)]
            slots, lease = tier.reserve([key], lease_s=60, namespace=NAMESPACE)
            if slots[0] is not None:
                tier.arena.view(slots[0])[:] = page_content(key, slot_bytes)
                tier.commit(key, [(0, slot_bytes)])
            tier.release(lease.lease_id)
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


def _tiers(agent, count: int, pages_each: int, slot_bytes: int, l3_stores=None) -> list[CacheTier]:
    stores = l3_stores or [None] * count
    return [
        CacheTier(PageArena(agent, ArenaConfig(slot_bytes, capacity_pages=pages_each)), store)
        for store in stores
    ]


def _l3_stores(args, directory: Path, count: int, unique: int, run: int) -> list[L3Store]:
    """One L3 per shared server: file stores in `directory` sized to `--l3-pages` in total,
    or stores of one valkey server (its own capacity), flushed of the bench's pages first."""
    if args.l3.startswith(("valkey://", "redis://", "valkey-cluster://", "redis-cluster://")):
        stores = [open_store(args.l3) for _ in range(count)]
        stores[0].flush(NAMESPACE)
        return stores
    pages_each = max(1, (args.l3_pages or unique) // count)
    capacity = pages_each * (record.HEADER_BYTES + args.slot_bytes)
    return [
        open_store(f"file:{directory / f'run{run}-server{i}'}", capacity_bytes=capacity)
        for i in range(count)
    ]


def _l3_dir(args: argparse.Namespace) -> str | None:
    """Where the file L3 stores go: `--l3-dir`, else tmpfs (/dev/shm) when there is one.

    The replay measures hit rates and bytes, not a disk: on this machine's
    ext4 volume unlinking and renaming small files costs ~0.5 ms each.
    """
    if args.l3_dir:
        return args.l3_dir
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


async def _run(args: argparse.Namespace) -> dict:
    requests = load_trace(args.trace, args.limit)
    chain = KeyChain(args.block_tokens)
    key_lists = [chain.keys(r["hash_ids"]) for r in requests]
    unique = len({k for keys in key_lists for k in keys})
    capacities = [int(c) for c in args.capacities.split(",")] if args.capacities else None
    if not capacities:
        capacities = [max(args.workers, int(unique * f)) for f in (0.05, 0.1, 0.25, 0.5, 1.0)]
    with_l3 = args.l3 != "none"
    runs_each = 3 if with_l3 else 2
    bar = progress_bar(len(requests) * (1 + runs_each * len(capacities)), args.no_progress)
    agent = await create_agent("loopback", token="bench-cache", fast_path=False)
    page_bytes = args.page_bytes
    results = {"infinite": _replay_infinite(requests, key_lists, args, bar.update).to_json(0)}
    ring = HashRing([f"server-{i}" for i in range(args.servers)])
    server_of = {name: i for i, name in enumerate(ring.servers)}

    def by_worker(n, _k):
        return n % args.workers

    def by_ring(_n, k):
        return server_of[ring.server_for(k)]

    results["capacities"] = []
    with tempfile.TemporaryDirectory(prefix="kvrelay-bench-l3-", dir=_l3_dir(args)) as scratch:
        for run, capacity in enumerate(capacities):
            policies = {
                "local": (args.workers, by_worker, None),
                "shared": (args.servers, by_ring, None),
            }
            if with_l3:
                stores = _l3_stores(args, Path(scratch), args.servers, unique, run)
                policies["shared_l3"] = (args.servers, by_ring, stores)
            entry = {"capacity_pages": capacity, "capacity_bytes": capacity * page_bytes}
            for name, (count, route, stores) in policies.items():
                tiers = _tiers(agent, count, max(1, capacity // count), args.slot_bytes, stores)
                counts = _replay_tiers(tiers, route, requests, key_lists, args, bar.update)
                entry[name] = counts.to_json(page_bytes)
                for tier in tiers:
                    tier.arena.close(force=True)
                    if tier.l3 is not None:
                        tier.l3.flush(NAMESPACE)
                        tier.l3.close()
            results["capacities"].append(entry)
    bar.close()
    await agent.close()
    return _report(args, requests, unique, results)


def _report(args: argparse.Namespace, requests, unique: int, results: dict) -> dict:
    """Prints the tables, returns the JSON payload; SystemExit if any hit
    page had the wrong bytes."""
    with_l3, page_bytes = args.l3 != "none", args.page_bytes
    payload = {
        "bench": "cache",
        "trace": str(args.trace),
        "requests": len(requests),
        "unique_pages": unique,
        "workers": args.workers,
        "servers": args.servers,
        "block_tokens": args.block_tokens,
        "page_bytes": page_bytes,
        "slot_bytes": args.slot_bytes,
        "l3": args.l3,
        "l3_pages": (args.l3_pages or unique) if with_l3 else 0,
        "machine": machine_info(),
        **results,
    }
    print(format_table(HEADERS, [row(e, results["infinite"]) for e in payload["capacities"]]))
    if with_l3:
        print()
        print(format_table(L3_HEADERS, [l3_row(e, page_bytes) for e in payload["capacities"]]))
    wrong = sum(
        e[p]["wrong_pages"] for e in payload["capacities"] for p in ("local", "shared", "shared_l3")
        if p in e
    )  # fmt: skip
    if wrong:
        raise SystemExit(f"bench cache: {wrong} hit pages had the wrong bytes")
    return payload


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
    parser.add_argument(
        "--l3", default="file",
        help="L3 of the shared tier: file (per-server stores in a temp dir), valkey://HOST:PORT"
        " (one shared server), valkey-cluster://HOST:PORT[,...] (a cluster; valkey-cluster"
        " alone starts a local one of 3 primaries + 3 replicas), or none",
    )  # fmt: skip
    parser.add_argument(
        "--l3-pages", type=int, default=None,
        help="total file L3 capacity in pages (default: the trace's distinct pages)",
    )  # fmt: skip
    parser.add_argument(
        "--l3-dir", default=None, help="directory for the file L3 stores (default: /dev/shm)"
    )
    parser.add_argument(
        "--slot-bytes", type=int, default=256,
        help="bytes of a page in the replay (L2 slots, L3 records); hit rates do not depend on it",
    )  # fmt: skip
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--plot", metavar="PNG", help="plot hit rate vs capacity here")
    parser.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> dict:
    with local_l3(args.l3) as url:
        args.l3 = url
        payload = asyncio.run(_run(args))
    if args.json:
        write_json(args.json, payload)
    if args.plot:
        plot(payload, args.plot)
    return payload
