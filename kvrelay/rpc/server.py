"""The one accept loop of kvrelay's servers (transfer agent, cache server,
worker front): listen, hello with the cluster token, then requests.

Per connection: the first frame must be a `Hello` of this `WIRE_VERSION`
with the cluster token (compared in constant time) within `hello_timeout_s`,
else a typed `Error` reply and the connection closes. A server given
`scoped_welcome` also admits tenant-scoped tokens (`rpc.scope`), answered with
that welcome; `conn.scope` then says which namespaces the peer may touch. Then each frame is
decoded as the service's request union (a frame, once begun, must arrive within
`hello_timeout_s`; before the hello at most `MAX_HELLO_FRAME` bytes) and
passed to `handler(conn, request)`; what it returns (a message) is sent back, an exception it raises
is sent as an `Error` reply, a malformed request is answered
`MalformedMessage`. A handler that streams sends frames itself and returns
None. A lost connection or a broken frame ends the connection.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from kvrelay.rpc.errors import (
    AuthError,
    MalformedMessage,
    ProtocolError,
    RpcError,
    WireVersionError,
)
from kvrelay.rpc.framing import MAX_HELLO_FRAME, Connection, listen_socket
from kvrelay.rpc.messages import WIRE_VERSION, Error, Hello, Message
from kvrelay.rpc.scope import Scope, token_scope

log = logging.getLogger("kvrelay.rpc")

Handler = Callable[[Connection, Any], Awaitable[Message | None]]


class Server:
    def __init__(
        self,
        *,
        token: str,
        requests: Any,
        handler: Handler,
        welcome: Callable[[], Message],
        host: str = "127.0.0.1",
        port: int = 0,
        hello_timeout_s: float = 10.0,
        scoped_welcome: Callable[[Scope], Message] | None = None,
    ) -> None:
        if not token:
            raise ValueError("a server needs a non-empty cluster token")
        self.token = token
        self.requests = requests
        self.handler = handler
        self.welcome = welcome
        self.scoped_welcome = scoped_welcome
        self.host, self.port = host, port
        self.hello_timeout_s = hello_timeout_s
        self.address = ""
        self._listener: socket.socket | None = None
        self._accept: asyncio.Task | None = None
        self._conns: set[asyncio.Task] = set()

    async def start(self) -> Server:
        self._listener, self.address = listen_socket(self.host, self.port)
        self._accept = asyncio.create_task(self._accept_loop())
        return self

    async def stop_accepting(self) -> None:
        """Refuse new connections; those open keep being served."""
        if self._accept is not None:
            # Cancel first: closing a socket the loop still watches would
            # hand its fd number, still registered, to the next socket.
            self._accept.cancel()
            await asyncio.gather(self._accept, return_exceptions=True)
            self._accept = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    async def close(self) -> None:
        await self.stop_accepting()
        tasks = list(self._conns)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(self._listener)
            conn = Connection(sock)
            task = asyncio.create_task(self._serve(conn))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)
            # Also when the task is cancelled before it first runs.
            task.add_done_callback(lambda _, conn=conn: conn.close())

    async def _serve(self, conn: Connection) -> None:
        try:
            if not await self._hello(conn):
                return
            while True:
                try:
                    request = await conn.recv(self.requests, stall_timeout=self.hello_timeout_s)
                except MalformedMessage as exc:
                    await conn.send(Error.of(exc))
                    continue
                try:
                    reply = await self.handler(conn, request)
                except Exception as exc:  # answered, typed; a lost connection fails the send
                    log.debug("%s refused: %r", type(request).__name__, exc)
                    reply = Error.of(exc, getattr(request, "rid", None))
                if reply is not None:
                    await conn.send(reply)
        except ProtocolError as exc:  # a broken frame: say why, then drop it
            await _refuse(conn, exc)
        except (RpcError, TimeoutError, OSError):
            pass  # the peer went away: drop the connection
        finally:
            conn.close()

    async def _hello(self, conn: Connection) -> bool:
        async with asyncio.timeout(self.hello_timeout_s):
            try:
                hello = await conn.recv(Hello, MAX_HELLO_FRAME)
            except MalformedMessage:
                await conn.send(Error.of(AuthError("the first frame must be a hello")))
                return False
        if hello.v != WIRE_VERSION:
            refusal = WireVersionError(
                f"this peer speaks wire version {WIRE_VERSION}, the hello says {hello.v}"
            )
            await conn.send(Error.of(refusal))
            return False
        scope = token_scope(hello.token, self.token, scoped=self.scoped_welcome is not None)
        if scope is None:
            await conn.send(Error.of(AuthError("bad cluster token")))
            return False
        conn.scope = scope
        if scope.every_namespace:
            await conn.send(self.welcome())
        else:
            await conn.send(self.scoped_welcome(scope))
        return True


async def _refuse(conn: Connection, exc: Exception) -> None:
    """Best effort: tell a peer that spoke garbage why it is dropped."""
    try:
        async with asyncio.timeout(1.0):
            await conn.send(Error.of(exc))
    except (RpcError, TimeoutError, OSError):
        pass
