"""Faults of a cache server backed by a file L3 (write-through, so every
sealed page is on disk):

- `restart_cache_file`: the server is SIGKILLed at a random moment and
  started again on its address; its pages come back from disk. Checked
  after the round: the server is killed and restarted once more with no
  request running, the workers' pools are emptied, and the round's prompts
  are asked again: the new process must answer some pages from its L3
  (its `l3.hits` > 0), with the right tokens.
- `corrupt_file_l3`: one byte flipped in the middle of every page file,
  then the server killed and restarted (its L2 is empty, so lookups read
  the spoiled files); after the round, the prompts again from empty pools:
  the right tokens (a spoiled record is a miss, computed again), and the
  record checks must have caught it (`l3.checksum_failures` > 0).

Both checks need pages of the round's prompts on the server's disk, and a
round may leave none there: the kill can come before the round's first
pages reach the server, and pages pushed while it is down are dropped (a
miss later, never an error), and a dropped page cuts its prompt's prefix
(lookups stop at the first missing page on either server) so the pages
after it that did reach the disk are never asked for. So the round's
prompts are sent once more, every server up (each prompt's whole prefix is
then written), before the check; it is skipped (and counted in `skipped`)
only when still none of the round's pages are on this server's disk (page
files written, or read, which touches them, since the round began;
spoiling keeps a file's times)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import sys
import time

from kvrelay.chaos import frames
from kvrelay.chaos.cluster import ChaosCluster
from kvrelay.chaos.moments import signal_group
from kvrelay.chaos.workload import Workload

FILE_FAULTS = ("restart_cache_file", "corrupt_file_l3")
MAX_FILES = 5000


def spoil_files(cluster: ChaosCluster, i: int, rng: random.Random) -> int:
    """Flips one byte in the middle of each page file of cache i's L3; how many."""
    spoiled = 0
    for path in sorted(cluster.l3_dir(i).rglob("*"))[:MAX_FILES]:
        if not path.is_file() or path.parent.name == "tmp":
            continue
        data = bytearray(path.read_bytes())
        if len(data) < 64:
            continue
        times = path.stat()
        middle = len(data) // 2 + rng.randrange(-8, 8)
        data[middle] ^= 0xFF
        path.write_bytes(bytes(data))
        # Its times kept: they tell the round's pages (and the store's LRU order).
        os.utime(path, ns=(times.st_atime_ns, times.st_mtime_ns))
        spoiled += 1
    return spoiled


def round_pages(cluster: ChaosCluster, i: int, since_ns: int) -> int:
    """Page files of cache i's L3 written or read since `since_ns` (wall clock)."""
    count = 0
    for path in sorted(cluster.l3_dir(i).rglob("*.page"))[:MAX_FILES]:
        with contextlib.suppress(OSError):
            count += path.parent.name != "tmp" and path.stat().st_mtime_ns >= since_ns
    return count


class FileL3Faults:
    def __init__(self, cluster: ChaosCluster, rng: random.Random) -> None:
        self.cluster, self.rng = cluster, rng
        self.servers = [i for i in range(len(cluster.cache_addresses))
                        if cluster.l3_of(i) == "file"]  # fmt: skip
        self._server = 0
        self._round_ns = 0  # when the round began (`begin`)
        self.skipped = 0  # after-checks with none of the round's pages on the disk

    def begin(self) -> None:
        """A round starts: pages on disk from now on are its own."""
        self._round_ns = time.time_ns()

    def inject(self, name: str) -> bool:
        self._server = self.rng.choice(self.servers)
        return self.restart(name)

    def restart(self, name: str) -> bool:
        """(Spoils the files, then) kills and restarts the server; whether
        there was anything on disk to spoil."""
        spoiled = 1
        if name == "corrupt_file_l3":
            spoiled = spoil_files(self.cluster, self._server, self.rng)
        victim = self.cluster.find(f"cache{self._server}")
        if victim is not None:
            signal_group(victim, signal.SIGKILL)
        self.cluster.restart_cache(self._server)
        return spoiled > 0

    async def _writes_settled(self, timeout_s: float = 10.0) -> None:
        """Until the server's L3 puts stop changing: the round's write-backs
        (pushed after their requests ended) are on disk before the kill."""
        address = self.cluster.cache_addresses[self._server]
        last, deadline = None, asyncio.get_running_loop().time() + timeout_s
        while asyncio.get_running_loop().time() < deadline:
            stats = await self.cluster.cache_stats(address)
            puts = ((stats or {}).get("l3") or {}).get("puts")
            if puts is not None and puts == last:
                return
            last = puts
            await asyncio.sleep(1.0)

    async def _flush_workers(self) -> None:
        """Empties every worker's pool: the next prompts look the tier up."""
        for worker in self.cluster.ready("prefill") + self.cluster.ready("decode"):
            with contextlib.suppress(OSError, TimeoutError):
                await frames.call(worker.ready["address"], {"op": "flush"},
                                  self.cluster.config.token)  # fmt: skip

    async def after(self, name: str, workload: Workload, sessions: int, turns: int) -> int:
        """The round's prompts from empty pools against a server just
        restarted (its files spoiled again for `corrupt_file_l3`) with no
        request running: 1 when its L3 gave nothing back (or caught no
        spoiled record); 0 with no check (`skipped`) when none of the
        round's pages reached the server's disk, even after the second pass."""
        # The round's prompts once more, every server up: a page the kill
        # dropped cuts its prompt's prefix (lookups stop at the first missing
        # page, on whichever server), hiding the pages after it that did
        # reach this disk; this pass (from empty pools: the workers compute
        # what the tier lacks and write it) writes every prompt's whole prefix.
        await self._flush_workers()
        await workload.run(sessions, turns)
        await self._writes_settled()
        if not await asyncio.to_thread(round_pages, self.cluster, self._server, self._round_ns):
            self.skipped += 1
            return 0  # still none on its disk (all on the other server): nothing to check
        if not await asyncio.to_thread(self.restart, name):
            return 0  # nothing on disk yet: nothing to check
        await self._flush_workers()
        await workload.run(sessions, turns)
        stats = await self.cluster.cache_stats(self.cluster.cache_addresses[self._server])
        l3 = (stats or {}).get("l3") or {}
        wanted = "hits" if name == "restart_cache_file" else "checksum_failures"
        if l3.get(wanted, 0) == 0:  # shown: the row only counts it
            print(f"{name}: after-check failed: cache{self._server} l3 {l3 or stats}",
                  file=sys.stderr, flush=True)  # fmt: skip
            return 1
        return 0
