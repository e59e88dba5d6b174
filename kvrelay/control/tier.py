"""Control's view of the cache tier: probe a prefix, flush a namespace.

A probe is a `lookup` with a short lease (so the answer is not evicted
under us while we read it) followed at once by `release`; the pages are not
pulled. Keys are placed by the same `HashRing` as the workers' clients use,
and the hit is the global prefix: it ends at the first key its server
missed. A server that is down or slow counts as misses, never an error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvrelay.layout import HashRing, prefix_in_turns, ring_prefix
from kvrelay.rpc import Channel, Unavailable
from kvrelay.rpc.cache_ops import (
    CacheWelcome,
    Flush,
    FlushReply,
    Lookup,
    LookupReply,
    ReleaseLease,
    ReleaseReply,
)

PROBE_LEASE_S = 2.0


class TierProbe:
    def __init__(self, servers: Sequence[str], token: str, timeout_s: float = 1.0) -> None:
        self.token, self.timeout_s = token, timeout_s
        self.ring = HashRing(servers)
        self._servers = {a: Channel(a, token, CacheWelcome, timeout_s) for a in servers}
        self.probes = 0
        self.errors = 0

    @property
    def servers(self) -> list[str]:
        return self.ring.servers

    def set_servers(self, servers) -> None:
        """Follow a new ring: probes begun on the old one finish on it."""
        self.ring = HashRing(servers)
        for address in servers:
            if address not in self._servers:
                self._servers[address] = Channel(address, self.token, CacheWelcome, self.timeout_s)

    async def probe(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        """Pages of the longest prefix of `keys` the tier holds sealed right now
        (in turns where a server's L2 cannot hold its share at once)."""
        ring = self.ring  # a new ring published meanwhile applies to the next probe
        if not keys or not ring.servers:
            return 0
        self.probes += 1
        return await prefix_in_turns(
            len(keys), lambda start: self._probe_round(ring, namespace, keys[start:])
        )

    async def _probe_round(self, ring: HashRing, namespace: bytes, keys: Sequence[bytes]):
        groups = ring.group(keys)
        answers = await asyncio.gather(
            *(self._lookup(s, namespace, [keys[p] for p in ps]) for s, ps in groups.items())
        )
        found = dict(zip(groups, answers, strict=True))
        await asyncio.gather(
            *(self._release(s, lease) for s, (_, lease, _) in found.items() if lease is not None)
        )
        prefix, _ = ring_prefix(ring, keys, {s: a[0] for s, a in found.items()})
        return prefix, prefix < len(keys) and found[ring.server_for(keys[prefix])][2]

    async def _lookup(self, server: str, namespace: bytes, keys: list[bytes]):
        try:
            reply = await self._servers[server].call(
                Lookup(keys, PROBE_LEASE_S, namespace), LookupReply
            )
        except Unavailable:
            self.errors += 1
            return 0, None, False
        return reply.hits, reply.lease, reply.more

    async def _release(self, server: str, lease: int) -> None:
        try:
            await self._servers[server].call(ReleaseLease(lease), ReleaseReply)
        except Unavailable:
            self.errors += 1  # the lease runs out on its own

    async def flush(self, namespace: bytes | None) -> dict[str, int | None]:
        """Drop unpinned pages (of one namespace, or all) on every server;
        pages dropped per server, None for one that did not answer."""

        async def one(server: Channel) -> int | None:
            try:
                return (await server.call(Flush(namespace), FlushReply)).dropped
            except Unavailable:
                self.errors += 1
                return None

        servers = self.ring.servers
        results = await asyncio.gather(*(one(self._servers[s]) for s in servers))
        return dict(zip(servers, results, strict=True))

    def close(self) -> None:
        for server in self._servers.values():
            server.drop()
