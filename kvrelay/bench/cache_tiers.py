"""The tiers `kvrelay bench cache` replays through, and the L3 stores behind them."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from kvrelay.bench.cache_trace import NAMESPACE
from kvrelay.cache.arena import ArenaConfig, PageArena
from kvrelay.cache.eviction import DEFAULT_POLICY
from kvrelay.cache.l3 import L3Store, open_store, record
from kvrelay.cache.tier import CacheTier, TierConfig


def make_tiers(
    agent, count: int, pages_each: int, slot_bytes: int, l3_stores=None,
    eviction: str = DEFAULT_POLICY,
) -> list[CacheTier]:  # fmt: skip
    stores = l3_stores or [None] * count
    config = TierConfig(eviction=eviction)
    arena = ArenaConfig(slot_bytes, capacity_pages=pages_each)
    return [CacheTier(PageArena(agent, arena), store, config) for store in stores]


def ring_shares(keys, route, servers: int) -> list[int]:
    """How many of `keys` `route(request number, key)` places on each server."""
    shares = [0] * servers
    for key in keys:
        shares[route(0, key)] += 1
    return shares


# The `--l3` forms that name a valkey server or cluster (the rest: file, none).
L3_URLS = ("valkey://", "redis://", "valkey-cluster://", "redis-cluster://")


def l3_stores(args, directory: Path, shares: list[int], run: int, number: int = 0) -> list[L3Store]:
    """One L3 per shared server: file stores in `directory` holding `--l3-pages` split
    evenly, or each server's share of the working set (`shares`: the distinct pages the
    ring places on each), or stores of one valkey server or cluster (its own capacity),
    flushed of the bench's pages first. `run` and `number` (capacity and policy) name
    fresh directories."""
    count = len(shares)
    if args.l3.startswith(L3_URLS):
        stores = [open_store(args.l3) for _ in range(count)]
        stores[0].flush(NAMESPACE)
        return stores
    pages = [args.l3_pages // count] * count if args.l3_pages else shares
    return [
        open_store(
            f"file:{directory / f'run{run}-{number}-server{i}'}",
            capacity_bytes=max(1, pages[i]) * (record.HEADER_BYTES + args.slot_bytes),
        )
        for i in range(count)
    ]


def l3_dir(args: argparse.Namespace) -> str | None:
    """Where the file L3 stores go: `--l3-dir`, else tmpfs (/dev/shm) when there is one.

    The replay measures hit rates and bytes, not a disk: on this machine's
    ext4 volume unlinking and renaming small files costs ~0.5 ms each.
    """
    if args.l3_dir:
        return args.l3_dir
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


def close_tiers(tiers: list[CacheTier]) -> None:
    for tier in tiers:
        tier.arena.close(force=True)
        if tier.l3 is not None:
            tier.l3.flush(NAMESPACE)
            tier.l3.close()
