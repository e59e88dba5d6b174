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
  record checks must have caught it (`l3.checksum_failures` > 0)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal

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
        middle = len(data) // 2 + rng.randrange(-8, 8)
        data[middle] ^= 0xFF
        path.write_bytes(bytes(data))
        spoiled += 1
    return spoiled


class FileL3Faults:
    def __init__(self, cluster: ChaosCluster, rng: random.Random) -> None:
        self.cluster, self.rng = cluster, rng
        self.servers = [i for i in range(len(cluster.cache_addresses))
                        if cluster.l3_of(i) == "file"]  # fmt: skip
        self._server = 0

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

    async def after(self, name: str, workload: Workload, sessions: int, turns: int) -> int:
        """The round's prompts from empty pools against a server just
        restarted (its files spoiled again for `corrupt_file_l3`) with no
        request running: 1 when its L3 gave nothing back (or caught no
        spoiled record)."""
        if not await asyncio.to_thread(self.restart, name):
            return 0  # nothing on disk yet: nothing to check
        for worker in self.cluster.ready("prefill") + self.cluster.ready("decode"):
            with contextlib.suppress(OSError, TimeoutError):
                await frames.call(worker.ready["address"], {"op": "flush"},
                                  self.cluster.config.token)  # fmt: skip
        await workload.run(sessions, turns)
        stats = await self.cluster.cache_stats(self.cluster.cache_addresses[self._server])
        l3 = (stats or {}).get("l3") or {}
        wanted = "hits" if name == "restart_cache_file" else "checksum_failures"
        return int(l3.get(wanted, 0) == 0)
