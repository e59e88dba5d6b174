"""Faults that fill a resource while requests run (they must wait or go
without, never fail or crash), each confirmed full before it counts as
`at_moment`:

- `fill_cache`: a client reserves every slot of every cache server's arena
  (reservations pin their slots) and holds them; writes find no room
  (decode skips the write-back) and lookups still answer. After the
  release a new reservation must get a slot again.
- `full_staging`: each prefill gets direct requests whose published handles
  nobody pulls, until its staging rows are all held (confirmed by its
  stats); requests through control wait for rows (the handles' leases end
  after `STAGING_LEASE_S`).
- `full_decode_pool`: long generations through control (long prompts, many
  tokens) hold most of every decode pool while the workload runs; confirmed
  by a decode reporting fewer free pages than one more request needs, or a
  queue."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random

import httpx

from kvrelay.chaos import frames, setup
from kvrelay.chaos.cluster import ChaosCluster
from kvrelay.chaos.moments import params, until
from kvrelay.chaos.workload import Workload

STAGING_LEASE_S = 4.0
HOGS = 8  # long generations at once
HOG_PAGES, HOG_TOKENS = 24, 128
NEED_PAGES = 10  # pages of the workload's longest request (up to 130 tokens + 6)


class Pressure:
    def __init__(self, cluster: ChaosCluster, rng: random.Random) -> None:
        self.cluster, self.rng = cluster, rng
        self._leases: list[tuple[str, int]] = []
        self._tasks: list[asyncio.Task] = []

    async def inject(self, name: str, workload: Workload) -> bool:
        if name == "fill_cache":
            return await self._fill_cache()
        if name == "full_staging":
            return await self._fill_staging()
        return await self._fill_decode_pools(workload)

    async def clear(self, name: str) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:  # bounded by their own deadlines
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 120)
        leases, self._leases = self._leases, []
        for address, lease in leases:
            await self._call(address, {"op": "release", "lease": lease})

    async def after(self, name: str) -> int:
        """Problems left behind: a cache server whose arena takes no page."""
        if name != "fill_cache":
            return 0
        problems = 0
        for address in self.cluster.cache_addresses:
            key = hashlib.sha256(b"after %d" % self.rng.getrandbits(64)).digest()
            reply = await self._call(address, {"op": "reserve", "keys": [key], "lease_s": 5.0,
                                               "ns": setup.NS})  # fmt: skip
            if not frames.accepted(reply) or reply["slots"][0] is None:
                problems += 1
            else:
                await self._call(address, {"op": "release", "lease": reply["lease"]})
        return problems

    async def _call(self, address: str, message: dict) -> dict | None:
        try:
            return await frames.call(address, message, self.cluster.config.token, timeout=10)
        except (OSError, TimeoutError):
            return None

    async def _fill_cache(self) -> bool:
        full = 0
        for address in self.cluster.cache_addresses:
            for _ in range(16):  # 64 slots a reservation; an arena holds a few hundred
                keys = [hashlib.sha256(b"fill %d" % self.rng.getrandbits(64)).digest()
                        for _ in range(64)]  # fmt: skip
                reply = await self._call(address, {"op": "reserve", "keys": keys,
                                                   "lease_s": 60.0, "ns": setup.NS})  # fmt: skip
                if not frames.accepted(reply):
                    continue  # not answering (a restart still starting?): ask again
                self._leases.append((address, reply["lease"]))
                if None in reply["slots"]:
                    full += 1
                    break
        return full == len(self.cluster.cache_addresses)

    async def _fill_staging(self) -> bool:
        rows = self.cluster.chaos.staging_pages
        page = self.cluster.config.page_size
        prefills = self.cluster.ready("prefill")
        for prefill in prefills:
            for _ in range(rows // 4 + 2):  # four new pages each
                prompt = [self.rng.randrange(1, 256) for _ in range(4 * page)]
                request = {"op": "prefill", "rid": "fill", "tokens": frames.tokens(prompt),
                           "params": params(4), "lease_s": STAGING_LEASE_S}  # fmt: skip
                self._tasks.append(asyncio.create_task(
                    frames.call(prefill.ready["address"], request, self.cluster.config.token,
                                timeout=60)))  # fmt: skip

        async def some_full() -> bool:
            for prefill in prefills:
                stats = await self.cluster.worker_stats(prefill)
                if stats is not None and stats["staging_free"] == 0:
                    return True
            return False

        return await until(some_full, 5.0)

    async def _fill_decode_pools(self, workload: Workload) -> bool:
        page = self.cluster.config.page_size
        hog = Workload(workload.control_url, workload.oracle, max_tokens=HOG_TOKENS,
                       deadline_s=workload.deadline_s, margin_s=workload.margin_s)  # fmt: skip
        rng = random.Random(7)  # the same long prompts each time: the oracle remembers them
        prompts = [[rng.randrange(1, 256) for _ in range(HOG_PAGES * page + 3)]
                   for _ in range(HOGS)]  # fmt: skip

        async def hogs() -> None:
            async with httpx.AsyncClient(base_url=workload.control_url) as client:
                outcomes = await asyncio.gather(*(hog.one(client, p) for p in prompts))
            workload.outcomes.extend(outcomes)

        self._tasks.append(asyncio.create_task(hogs()))

        async def some_full() -> bool:
            for decode in self.cluster.ready("decode"):
                stats = await self.cluster.worker_stats(decode)
                if stats is not None and (stats["free_pages"] < NEED_PAGES or stats["queued"] > 0):
                    return True
            return False

        return await until(some_full, 8.0)
