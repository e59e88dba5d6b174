"""The ring a cache client places pages by, and following the versions control
publishes.

The ring starts as the configured list (version 0). Every `poll_s` the
follower asks the ring's servers, one after another until one answers, for
the ring control published last (`GetRing`) and moves to it when it is newer
and not empty. Channels of servers that left are kept: a call begun on an old
ring finishes on it (each call takes `ring` once).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from kvrelay.layout import HashRing
from kvrelay.rpc import Channel, Unavailable
from kvrelay.rpc.cache_ops import CacheWelcome, GetRing, RingReply


class RingFollower:
    def __init__(
        self,
        servers: Sequence[str],
        token: str,
        timeout_s: float,
        check: Callable[[CacheWelcome], str | None],
        poll_s: float,
    ) -> None:
        self.token, self.timeout_s, self.check, self.poll_s = token, timeout_s, check, poll_s
        self.ring = HashRing(servers)
        self.version = 0
        self.channels: dict[str, Channel] = {}
        self._add(servers)
        self._poller: asyncio.Task | None = None

    def _add(self, servers: Sequence[str]) -> None:
        for a in servers:
            if a not in self.channels:
                self.channels[a] = Channel(a, self.token, CacheWelcome, self.timeout_s, self.check)

    def set(self, version: int, servers: Sequence[str]) -> bool:
        """Move to ring `version` if it is newer and not empty."""
        if version <= self.version or not servers:
            return False
        self._add(servers)
        self.ring = HashRing(servers)
        self.version = version
        return True

    async def refresh(self) -> bool:
        for server in self.ring.servers:
            try:
                reply = await self.channels[server].call(GetRing(), RingReply)
            except Unavailable:
                continue
            return self.set(reply.version, reply.servers)
        return False

    def follow(self) -> None:
        """Start polling (once, from the caller's loop); a no-op with poll_s 0."""
        if self._poller is None and self.poll_s > 0:
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            await self.refresh()

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
            self._poller = None
        for channel in self.channels.values():
            channel.drop()
