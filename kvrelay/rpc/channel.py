"""A persistent connection to one service, for callers that make many small
calls (cache clients, control's tier probe): one call at a time, reconnect
after any failure and before a call when the peer closed the connection
since the last one (a restarted service), every call under a deadline that
covers the wait for the connection too.

Any failure of a call (no connection, deadline, refusal) raises
`Unavailable`, which the cache tier's callers answer as misses.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from kvrelay.rpc.client import call, connect
from kvrelay.rpc.errors import RemoteError, RpcError
from kvrelay.rpc.framing import Connection
from kvrelay.rpc.messages import Message

R = TypeVar("R", bound=Message)


class Unavailable(RpcError):
    """A call to a service did not complete (no connection, deadline, refusal)."""


class Channel:
    def __init__(
        self,
        address: str,
        token: str,
        welcome: type[Message],
        timeout_s: float,
        check: Callable[[Message], str | None] | None = None,
    ) -> None:
        self.address = address
        self.token = token
        self.welcome = welcome
        self.timeout_s = timeout_s
        self.check = check  # what is wrong with a welcome, None when it is fine
        self.conn: Connection | None = None
        self.lock = asyncio.Lock()

    async def call(self, request: Message, reply: type[R]) -> R:
        holding = False  # only the holder of the lock may close the connection
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.lock.acquire()
                holding = True
                if self.conn is not None and self.conn.closed_by_peer():
                    # The peer went away between calls (a restarted server):
                    # reconnect now rather than fail this call on the old one.
                    self.drop()
                if self.conn is None:
                    await self._connect()
                return await call(self.conn, request, reply, None)
        except RemoteError as exc:
            raise Unavailable(f"{self.address} refused: {exc}") from exc
        except (RpcError, TimeoutError, OSError) as exc:
            if holding:
                self.drop()
            raise Unavailable(f"{self.address}: {exc!r}") from exc
        finally:
            if holding:
                self.lock.release()

    async def _connect(self) -> None:
        self.conn, welcome = await connect(self.address, self.token, self.welcome, self.timeout_s)
        problem = self.check(welcome) if self.check is not None else None
        if problem:
            self.drop()
            raise Unavailable(f"{self.address}: {problem}")

    def drop(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None
