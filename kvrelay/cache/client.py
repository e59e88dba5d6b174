"""The worker side of the cache tier: find, pull and write pages of one rank's rectangle.

Pages are placed on servers by `HashRing` over their keys, so each call
splits its keys per server and talks to those servers concurrently. A server
that is down, slow or refusing counts as misses (lookups) or as pages not
written (writes): the tier never fails a request.

Local memory is a transfer `Arena` of the caller's agent in which page i of a
call sits in unified-page layout at `page_offsets[i]`; only the caller's
rectangle of each page is moved.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

from kvrelay.cache.ring import HashRing
from kvrelay.layout import ModelKVSpec, Rectangle
from kvrelay.transfer import Agent, Arena, TransferError
from kvrelay.transfer.wire import WIRE_VERSION, Connection


@dataclass(frozen=True, slots=True)
class CacheClientConfig:
    servers: tuple[str, ...]  # "host:port" control addresses
    token: str
    timeout_s: float = 2.0
    lease_s: float = 30.0


@dataclass(slots=True)
class ClientStats:
    lookups: int = 0
    lookup_pages: int = 0
    hit_pages: int = 0
    written_pages: int = 0
    bytes_in: int = 0  # pulled from the tier
    bytes_out: int = 0  # pushed to the tier
    errors: int = 0  # server calls that failed and were answered as misses


class ServerGone(Exception):
    """A cache server call failed; the caller treats it as misses."""


class _Server:
    def __init__(self, address: str, config: CacheClientConfig, page_bytes: int) -> None:
        self.address = address
        self.config = config
        self.page_bytes = page_bytes
        self.conn: Connection | None = None
        self.lock = asyncio.Lock()

    async def call(self, message: dict) -> dict:
        async with self.lock:
            try:
                async with asyncio.timeout(self.config.timeout_s):
                    if self.conn is None:
                        await self._connect()
                    await self.conn.send(message)
                    reply = await self.conn.recv()
            except (TransferError, TimeoutError, OSError) as exc:
                self.drop()
                raise ServerGone(f"cache server {self.address}: {exc!r}") from None
        if not reply.get("ok"):
            raise ServerGone(f"cache server {self.address} refused: {reply.get('message')}")
        return reply

    async def _connect(self) -> None:
        host, port = self.address.rsplit(":", 1)
        self.conn = await Connection.open(host, int(port))
        await self.conn.send({"op": "hello", "v": WIRE_VERSION, "token": self.config.token})
        hello = await self.conn.recv()
        if not hello.get("ok") or hello.get("page_bytes") != self.page_bytes:
            self.drop()
            raise ServerGone(f"cache server {self.address} refused hello: {hello!r:.200}")

    def drop(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class CacheClient:
    def __init__(
        self, agent: Agent, spec: ModelKVSpec, rect: Rectangle, config: CacheClientConfig
    ) -> None:
        self.agent = agent
        self.spec = spec
        self.rect = rect
        self.config = config
        self.runs = rect.byte_runs(spec)
        self.namespace = spec.namespace()
        self.ring = HashRing(config.servers)
        self.stats = ClientStats()
        self._servers = {a: _Server(a, config, spec.page_bytes) for a in config.servers}

    async def close(self) -> None:
        for server in self._servers.values():
            server.drop()

    def _local_offsets(self, page_offsets: Sequence[int], positions: Sequence[int]) -> list[int]:
        return [page_offsets[p] + offset for p in positions for offset, _ in self.runs]

    async def lookup(self, keys: Sequence[bytes], dest: Arena, page_offsets: Sequence[int]) -> int:
        """Pull this rank's rectangle of the longest cached prefix of `keys`; return its length."""
        self.stats.lookups += 1
        self.stats.lookup_pages += len(keys)
        groups = self.ring.group(keys)
        answers = await asyncio.gather(
            *(self._lookup_one(s, [keys[p] for p in ps]) for s, ps in groups.items())
        )
        found = {s: a for s, a in zip(groups, answers, strict=True)}
        # The prefix ends at the first key its server did not hit.
        taken = dict.fromkeys(groups, 0)
        prefix = 0
        for key in keys:
            server = self.ring.server_for(key)
            if taken[server] >= found[server][0]:
                break
            taken[server] += 1
            prefix += 1
        pulls = []
        for server, positions in groups.items():
            lease = found[server][1]
            count = taken[server]
            if count:
                pulls.append(self._pull(server, lease, positions[:count], dest, page_offsets))
        results = await asyncio.gather(*pulls, return_exceptions=True)
        await self._release_all([(s, a[1]) for s, a in found.items() if a[1] is not None])
        if any(isinstance(r, BaseException) for r in results):
            # A pull failed midway: which pages arrived is unknown, so none count.
            self.stats.errors += 1
            return 0
        self.stats.hit_pages += prefix
        return prefix

    async def _lookup_one(self, server: str, keys: list[bytes]) -> tuple[int, int | None]:
        try:
            reply = await self._servers[server].call(
                {"op": "lookup", "keys": keys, "lease_s": self.config.lease_s, "ns": self.namespace}
            )
        except ServerGone:
            self.stats.errors += 1
            return 0, None
        return reply["hits"], reply["lease"]

    async def _pull(self, server, lease, positions, dest, page_offsets) -> None:
        reply = await self._servers[server].call(
            {"op": "handle", "lease": lease, "count": len(positions), "runs": self.runs,
             "ns": self.namespace}
        )  # fmt: skip
        offsets = self._local_offsets(page_offsets, positions)
        await self.agent.read(
            reply["handle"], dest, offsets, namespace=self.namespace, timeout=self.config.timeout_s
        )
        self.stats.bytes_in += len(positions) * self.rect.num_bytes(self.spec)

    async def write(self, keys: Sequence[bytes], src: Arena, page_offsets: Sequence[int]) -> int:
        """Push this rank's rectangle of full pages `keys`; return how many pages went in.

        A page seals on its server when every writer rectangle is in. Replica
        ranks that do not write (`rect.writer` False) push nothing.
        """
        if not self.rect.writer or not keys:
            return 0
        groups = self.ring.group(keys)
        written = await asyncio.gather(
            *(self._write_one(s, ps, keys, src, page_offsets) for s, ps in groups.items())
        )
        self.stats.written_pages += sum(written)
        return sum(written)

    async def _write_one(self, server, positions, keys, src, page_offsets) -> int:
        conn = self._servers[server]
        mine = [keys[p] for p in positions]
        lease = None
        try:
            reply = await conn.call(
                {"op": "reserve", "keys": mine, "lease_s": self.config.lease_s,
                 "ns": self.namespace}
            )  # fmt: skip
            lease = reply["lease"]
            todo = [
                p for p, slot in zip(positions, reply["slots"], strict=True) if slot is not None
            ]
            if not todo:
                return 0
            reply = await conn.call(
                {"op": "handle", "lease": lease, "count": len(todo), "runs": self.runs,
                 "ns": self.namespace}
            )  # fmt: skip
            await self.agent.write(
                reply["handle"],
                src,
                self._local_offsets(page_offsets, todo),
                namespace=self.namespace,
                timeout=self.config.timeout_s,
            )
            await conn.call({"op": "commit", "keys": [keys[p] for p in todo], "runs": self.runs})
            self.stats.bytes_out += len(todo) * self.rect.num_bytes(self.spec)
            return len(todo)
        except (ServerGone, TransferError):
            self.stats.errors += 1
            return 0
        finally:
            if lease is not None:
                await self._release_all([(server, lease)])

    async def server_stats(self) -> dict[str, dict | None]:
        """Each server's tier and L3 statistics (evictions, demotions, promotions,
        checksum failures, ...); None for a server that did not answer."""

        async def one(server: str) -> dict | None:
            try:
                reply = await self._servers[server].call({"op": "stats"})
            except ServerGone:
                return None
            return {k: v for k, v in reply.items() if k != "ok"}

        replies = await asyncio.gather(*(one(s) for s in self._servers))
        return dict(zip(self._servers, replies, strict=True))

    async def _release_all(self, leases: list[tuple[str, int]]) -> None:
        async def release(server: str, lease: int) -> None:
            # A lost release only keeps pages pinned until the lease expires.
            with contextlib.suppress(ServerGone):
                await self._servers[server].call({"op": "release", "lease": lease})

        await asyncio.gather(*(release(s, lease) for s, lease in leases))
