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
