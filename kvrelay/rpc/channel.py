"""A persistent connection to one service, for callers that make many small
calls (cache clients, control's tier probe): one call at a time, reconnect
after any failure and before a call when the peer closed the connection
since the last one (a restarted service), every call under a deadline that
covers the wait for the connection too.

Any failure of a call (no connection, deadline, refusal) raises
`Unavailable`, which the cache tier's callers answer as misses.

`post` sends a request whose answer nobody waits for (a lease release): its
reply is read, and dropped, before the next call's request goes out. Replies
come in request order on one connection, so a posted request costs the
caller no round trip and keeps calls and replies paired.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from kvrelay.rpc.client import answer, call, connect
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
        self._posted: deque[type[Message]] = deque()  # replies of posted requests, unread

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
                await self._drain_posted()
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

    async def post(self, request: Message, reply: type[Message]) -> bool:
        """Send `request` on the open connection without waiting for its reply
        (`reply`: its type, read and dropped before the next call). False when
        it was not sent: no connection, or the send failed (best effort)."""
        holding = False
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.lock.acquire()
                holding = True
                if self.conn is None or self.conn.closed_by_peer():
                    return False
                await self.conn.send(request)
                self._posted.append(reply)
                return True
        except (RpcError, TimeoutError, OSError):
            if holding:
                self.drop()
            return False
        finally:
            if holding:
                self.lock.release()

    async def _drain_posted(self) -> None:
        while self._posted:
            kind = self._posted.popleft()
            with contextlib.suppress(RemoteError):  # a refused post: nobody waits for it
                await answer(self.conn, kind)

    async def _connect(self) -> None:
        self.conn, welcome = await connect(self.address, self.token, self.welcome, self.timeout_s)
        problem = self.check(welcome) if self.check is not None else None
        if problem:
            self.drop()
            raise Unavailable(f"{self.address}: {problem}")

    def drop(self) -> None:
        self._posted.clear()  # their replies went with the connection
        if self.conn is not None:
            self.conn.close()
            self.conn = None
