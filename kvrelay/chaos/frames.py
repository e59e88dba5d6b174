"""A raw frame client: sends exactly the bytes it is given and says what
the server did with them (a typed refusal, an answer, a close, nothing)."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from dataclasses import dataclass

import msgpack

from kvrelay.rpc.framing import FRAME_HEADER

WIRE_VERSION = 2

REFUSED = "refused"  # a map {op: "error", error: "<TypeName>", ...}
ACCEPTED = "accepted"  # a typed answer: a map with another op
CLOSED = "closed"  # the server closed the connection without a frame
HUNG = "hung"  # neither a frame nor a close within the probe's deadline
BAD_REPLY = "bad_reply"  # a frame that is not a typed answer


def frame(message) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    return FRAME_HEADER.pack(len(body)) + body


def tokens(ids) -> bytes:
    """Token ids as wire version 2 carries them: packed little-endian uint32."""
    return struct.pack(f"<{len(ids)}I", *ids)


def raw_frame(body: bytes) -> bytes:
    return FRAME_HEADER.pack(len(body)) + body


def hello(token: str) -> bytes:
    return frame({"op": "hello", "v": WIRE_VERSION, "token": token})


@dataclass(slots=True)
class Outcome:
    kind: str
    error: str = ""  # the refusal's type name
    reply: dict | None = None


async def read_frame(reader: asyncio.StreamReader) -> dict | None:
    """The next frame as a map, or None when the server closed first."""
    try:
        header = await reader.readexactly(FRAME_HEADER.size)
        body = await reader.readexactly(FRAME_HEADER.unpack(header)[0])
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    reply = msgpack.unpackb(body, raw=False)
    return reply if isinstance(reply, dict) else {"not_a_map": reply}


def accepted(reply: dict | None) -> bool:
    """A typed answer that is not an error reply."""
    return bool(reply) and isinstance(reply.get("op"), str) and reply["op"] != "error"


def classify(reply: dict | None) -> Outcome:
    if reply is None:
        return Outcome(CLOSED)
    if accepted(reply):
        return Outcome(ACCEPTED, reply=reply)
    error = reply.get("error")
    if reply.get("op") == "error" and isinstance(error, str) and error:
        return Outcome(REFUSED, error, reply)
    return Outcome(BAD_REPLY, reply=reply)


async def probe(
    address: str,
    payload: bytes,
    *,
    token: str | None,
    half_close: bool = False,
    timeout: float = 10.0,
) -> Outcome:
    """Connect, say hello with `token` (None: no hello, the payload comes
    first), send `payload`, and classify the first frame that comes back."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        async with asyncio.timeout(timeout):
            if token is not None:
                writer.write(hello(token))
                answer = await read_frame(reader)
                if not accepted(answer):
                    return Outcome(BAD_REPLY, reply=answer)
            writer.write(payload)
            await writer.drain()
            if half_close:
                writer.write_eof()
            return classify(await read_frame(reader))
    except TimeoutError:
        return Outcome(HUNG)
    except ConnectionError:
        return Outcome(CLOSED)
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def call(address: str, message: dict, token: str, timeout: float = 30.0) -> dict | None:
    """One well-formed request after the hello; its first reply frame."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        async with asyncio.timeout(timeout):
            writer.write(hello(token) + frame(message))
            await writer.drain()
            answer = await read_frame(reader)
            if not accepted(answer):
                return answer
            return await read_frame(reader)
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def silent_client_dropped(address: str, *, trickle_s: float | None, limit: float) -> bool:
    """A client that sends nothing (or one byte of a hello every `trickle_s`):
    True when the server drops it within `limit` seconds."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    data = hello("x" * 64)
    try:
        async with asyncio.timeout(limit):
            for i in range(len(data) if trickle_s else 1):
                if trickle_s:
                    writer.write(data[i : i + 1])
                    with contextlib.suppress(ConnectionError):
                        await writer.drain()
                got = await _read_or_wait(reader, trickle_s or limit)
                if got is not None:
                    return got == b""
            return False
    except TimeoutError:
        return False
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def _read_or_wait(reader: asyncio.StreamReader, seconds: float) -> bytes | None:
    """b"" once the server closed, None if it is still open after `seconds`."""
    try:
        data = await asyncio.wait_for(reader.read(1 << 16), seconds)
    except TimeoutError:
        return None
    except ConnectionError:
        return b""
    return data or b""
