"""The client side of the RPC layer: connect and hello, calls with deadlines."""

from __future__ import annotations

import asyncio
from typing import TypeVar

from kvrelay.rpc.errors import MalformedMessage, PeerError, RpcTimeout, WireVersionError
from kvrelay.rpc.framing import Connection, split_address
from kvrelay.rpc.messages import WIRE_VERSION, Error, Hello, Message

W = TypeVar("W", bound=Message)


async def connect(address: str, token: str, welcome: type[W], timeout_s: float):
    """A connection to `address` past the hello, and the server's welcome.

    Raises `PeerError` (no connection), `AuthError` (token refused),
    `WireVersionError` (another wire version), `RpcTimeout`."""
    try:
        host, port = split_address(address)
    except ValueError as exc:
        raise PeerError(str(exc)) from exc
    try:
        async with asyncio.timeout(timeout_s):
            conn = await Connection.open(host, port)
    except TimeoutError as exc:
        raise RpcTimeout(f"{address} did not accept within {timeout_s:g} s") from exc
    try:
        return conn, await hello(conn, token, welcome, timeout_s)
    except BaseException:
        conn.close()
        raise


async def hello(conn: Connection, token: str, welcome: type[W], timeout_s: float) -> W:
    """Sends the hello on an open connection; the server's welcome."""
    try:
        async with asyncio.timeout(timeout_s):
            await conn.send(Hello(v=WIRE_VERSION, token=token))
            try:
                reply = await conn.recv(welcome | Error)
            except MalformedMessage as exc:
                # A peer of wire version 1 answers with an untagged map.
                raise WireVersionError(
                    f"the hello was answered in another wire format "
                    f"(not version {WIRE_VERSION}): {exc}"
                ) from exc
    except TimeoutError as exc:
        raise RpcTimeout(f"no answer to the hello within {timeout_s:g} s") from exc
    if isinstance(reply, Error):
        raise reply.exception()
    return reply


async def call(conn: Connection, request: Message, reply: type[W], timeout_s: float | None) -> W:
    """Send `request`, return its reply as `reply`; an `Error` reply raises
    its exception (`RemoteError` with the peer's class name)."""
    try:
        async with asyncio.timeout(timeout_s):
            await conn.send(request)
            return await answer(conn, reply)
    except TimeoutError as exc:
        raise RpcTimeout(f"{type(request).__name__} got no reply within {timeout_s:g} s") from exc


async def answer(conn: Connection, reply: type[W]) -> W:
    """The next frame as `reply`; an `Error` reply raises its exception."""
    message = await conn.recv(reply | Error)
    if isinstance(message, Error):
        raise message.exception()
    return message
