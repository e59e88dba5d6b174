"""One persistent msgpack connection to a cache server, and the prefix rule
over servers: what workers' `CacheClient`s and control's tier probes share.

A call holds the connection for its round trip; waiting for it counts
against the call's timeout, and any failure closes the connection (the next
call connects again) and raises `ServerGone`, which callers treat as misses.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvrelay.cache.ring import HashRing
from kvrelay.transfer.errors import TransferError
from kvrelay.transfer.wire import WIRE_VERSION, Connection


class ServerGone(Exception):
    """A cache server call failed; the caller treats it as misses."""


class ServerConnection:
    def __init__(
        self, address: str, token: str, timeout_s: float, page_bytes: int | None = None
    ) -> None:
        self.address = address
        self.token = token
        self.timeout_s = timeout_s
        self.page_bytes = page_bytes  # checked against the server's hello when given
        self.conn: Connection | None = None
        self.lock = asyncio.Lock()

    async def call(self, message: dict) -> dict:
        holding = False  # only the holder of the lock may close the connection
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.lock.acquire()
                holding = True
                if self.conn is None:
                    await self._connect()
                await self.conn.send(message)
                reply = await self.conn.recv()
        except (TransferError, TimeoutError, OSError, ServerGone) as exc:
            if holding:
                self.drop()
            raise ServerGone(f"cache server {self.address}: {exc!r}") from None
        finally:
            if holding:
                self.lock.release()
        if not reply.get("ok"):
            raise ServerGone(f"cache server {self.address} refused: {reply.get('message')}")
        return reply

    async def _connect(self) -> None:
        host, port = self.address.rsplit(":", 1)
        self.conn = await Connection.open(host, int(port))
        await self.conn.send({"op": "hello", "v": WIRE_VERSION, "token": self.token})
        hello = await self.conn.recv()
        wrong_size = self.page_bytes is not None and hello.get("page_bytes") != self.page_bytes
        if not hello.get("ok") or wrong_size:
            raise ServerGone(f"refused hello: {hello!r:.200}")

    def drop(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def ring_prefix(
    ring: HashRing, keys: Sequence[bytes], hits: dict[str, int]
) -> tuple[int, dict[str, int]]:
    """The tier's prefix of `keys` when server s holds the first `hits[s]` of
    its share: it ends at the first key its server missed. Returns its length
    and how many of each server's keys it takes."""
    taken = dict.fromkeys(hits, 0)
    prefix = 0
    for key in keys:
        server = ring.server_for(key)
        if taken[server] >= hits[server]:
            break
        taken[server] += 1
        prefix += 1
    return prefix, taken
