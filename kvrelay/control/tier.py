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

from kvrelay.cache.ring import HashRing
from kvrelay.transfer.errors import TransferError
from kvrelay.transfer.wire import WIRE_VERSION, Connection

PROBE_LEASE_S = 2.0


class TierUnavailable(Exception):
    pass


class _Server:
    """One persistent connection to a cache server, one call at a time."""

    def __init__(self, address: str, token: str, timeout_s: float) -> None:
        self.address = address
        self.token = token
        self.timeout_s = timeout_s
        self.conn: Connection | None = None
        self.lock = asyncio.Lock()

    async def call(self, message: dict) -> dict:
        # Waiting for the connection counts against the timeout too; only the
        # holder of the lock may close it.
        holding = False
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.lock.acquire()
                holding = True
                if self.conn is None:
                    await self._connect()
                await self.conn.send(message)
                reply = await self.conn.recv()
        except (TransferError, TimeoutError, OSError, TierUnavailable) as exc:
            if holding:
                self.close()
            raise TierUnavailable(f"cache server {self.address}: {exc!r}") from None
        finally:
            if holding:
                self.lock.release()
        if not reply.get("ok"):
            raise TierUnavailable(f"cache server {self.address}: {reply.get('message')}")
        return reply

    async def _connect(self) -> None:
        host, port = self.address.rsplit(":", 1)
        self.conn = await Connection.open(host, int(port))
        await self.conn.send({"op": "hello", "v": WIRE_VERSION, "token": self.token})
        hello = await self.conn.recv()
        if not hello.get("ok"):
            raise TierUnavailable(f"hello refused: {hello.get('message')}")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class TierProbe:
    def __init__(self, servers: Sequence[str], token: str, timeout_s: float = 1.0) -> None:
        self.ring = HashRing(servers)
        self._servers = {a: _Server(a, token, timeout_s) for a in servers}
        self.probes = 0
        self.errors = 0

    @property
    def servers(self) -> list[str]:
        return self.ring.servers

    async def probe(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        """Pages of the longest prefix of `keys` the tier holds sealed right now."""
        if not keys or not self._servers:
            return 0
        self.probes += 1
        groups = self.ring.group(keys)
        answers = await asyncio.gather(
            *(self._lookup(s, namespace, [keys[p] for p in ps]) for s, ps in groups.items())
        )
        hits = {s: a[0] for s, a in zip(groups, answers, strict=True)}
        await asyncio.gather(
            *(self._release(s, lease) for s, (_, lease) in zip(groups, answers, strict=True)
              if lease is not None)
        )  # fmt: skip
        taken = dict.fromkeys(groups, 0)
        prefix = 0
        for key in keys:
            server = self.ring.server_for(key)
            if taken[server] >= hits[server]:
                break
            taken[server] += 1
            prefix += 1
        return prefix

    async def _lookup(self, server: str, namespace: bytes, keys: list[bytes]):
        try:
            reply = await self._servers[server].call(
                {"op": "lookup", "keys": keys, "lease_s": PROBE_LEASE_S, "ns": namespace}
            )
        except TierUnavailable:
            self.errors += 1
            return 0, None
        return int(reply.get("hits", 0)), reply.get("lease")

    async def _release(self, server: str, lease: int) -> None:
        try:
            await self._servers[server].call({"op": "release", "lease": lease})
        except TierUnavailable:
            self.errors += 1  # the lease runs out on its own

    async def flush(self, namespace: bytes | None) -> dict[str, int | None]:
        """Drop unpinned pages (of one namespace, or all) on every server;
        pages dropped per server, None for one that did not answer."""

        async def one(server: _Server) -> int | None:
            message = {"op": "flush"} if namespace is None else {"op": "flush", "ns": namespace}
            try:
                return int((await server.call(message)).get("dropped", 0))
            except TierUnavailable:
                self.errors += 1
                return None

        results = await asyncio.gather(*(one(s) for s in self._servers.values()))
        return dict(zip(self._servers, results, strict=True))

    def close(self) -> None:
        for server in self._servers.values():
            server.close()
