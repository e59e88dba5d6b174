"""Frames: 4-byte big-endian length + one msgpack message, over a raw socket.

`send` takes a message struct (or, for tests and raw tools, a plain map);
`recv(kind)` decodes and validates the next frame as `kind` (a message type
or a union of them) in one place: a frame that is not msgpack or exceeds
`MAX_FRAME` is a `ProtocolError` (the stream cannot be trusted: drop it),
a well-framed message of the wrong shape a `MalformedMessage` (answer it,
keep the connection). The tcp transfer backend moves raw page bytes on the
same socket right after a frame that announces them (`readv` / `writev`
on a worker thread, `transfer/backends/tcp.py`). No pickle: msgpack only.
"""

from __future__ import annotations

import asyncio
import functools
import select
import socket
import struct
from typing import Any, TypeVar

import msgspec

from kvrelay.rpc.errors import MalformedMessage, PeerError, ProtocolError

MAX_FRAME = 16 << 20  # a read of 2**20 runs needs about 10 MiB of msgpack
# Before the hello nobody is authenticated: a stranger's frame is small, so
# it cannot make the server allocate (and unpack) megabytes.
MAX_HELLO_FRAME = 64 << 10
# Every frame: its body's length as a big-endian uint32, then the body.
FRAME_HEADER = struct.Struct(">I")
_ENCODER = msgspec.msgpack.Encoder()
T = TypeVar("T")


@functools.cache
def _decoder(kind) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(kind)


def decode(body: bytes, kind: type[T] | Any = Any) -> T:
    """One message body as `kind`; the one place frames are validated."""
    try:
        return _decoder(kind).decode(body)
    except msgspec.ValidationError as exc:
        raise MalformedMessage(f"malformed message: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"frame is not valid msgpack: {exc}") from exc


def encode(message) -> bytes:
    return _ENCODER.encode(message)


def framed(message) -> bytes:
    """`message` as one frame: its length header and its msgpack body."""
    body = encode(message)
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"frame of {len(body)} bytes exceeds {MAX_FRAME}")
    return FRAME_HEADER.pack(len(body)) + body


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address must be HOST:PORT, got {address!r}")
    return host, int(port)


class Connection:
    """One control connection on a non-blocking socket, used by one task at a
    time (`lock` serialises callers that share it)."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.lock = asyncio.Lock()
        # What the peer may touch, set by a server's hello (`rpc.scope.Scope`).
        self.scope = None
        # Asked before every pull from a peer: a poll with nothing to report
        # costs one system call, where a peek raised and caught an exception
        # (about 85 us per pull from a cold cache).
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN | select.POLLRDHUP)

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, (host, port))
        except OSError as exc:
            sock.close()
            raise PeerError(f"cannot connect to {host}:{port}: {exc}") from exc
        except BaseException:  # a deadline or a cancellation mid-connect
            sock.close()
            raise
        return cls(sock)

    async def send(self, message) -> None:
        await self.send_bytes(framed(message))

    async def recv_body(self, max_size: int = MAX_FRAME, stall_timeout: float | None = None):
        """The next frame's bytes. The wait for its first byte is the caller's;
        once it started, the rest must arrive within `stall_timeout` (a peer
        sending a byte a second must not hold the connection)."""
        header = bytearray(FRAME_HEADER.size)
        await self.recv_into(memoryview(header)[:1])
        async with asyncio.timeout(stall_timeout):
            await self.recv_into(memoryview(header)[1:])
            (length,) = FRAME_HEADER.unpack(header)
            if length > max_size:
                raise ProtocolError(f"frame of {length} bytes exceeds {max_size}")
            body = bytearray(length)
            await self.recv_into(memoryview(body))
        return bytes(body)

    async def recv(
        self,
        kind: type[T] | Any = dict,
        max_size: int = MAX_FRAME,
        stall_timeout: float | None = None,
    ) -> T:
        """The next frame decoded as `kind` (default: a plain map, for raw tools)."""
        return decode(await self.recv_body(max_size, stall_timeout), kind)

    async def send_bytes(self, data) -> None:
        try:
            await self.loop.sock_sendall(self.sock, data)
        except OSError as exc:
            raise PeerError(f"connection lost while sending: {exc}") from exc

    async def recv_into(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            try:
                n = await self.loop.sock_recv_into(self.sock, view[got:])
            except OSError as exc:
                raise PeerError(f"connection lost while receiving: {exc}") from exc
            if n == 0:
                raise PeerError("the peer closed the connection")
            got += n

    def closed_by_peer(self) -> bool:
        """True once the peer closed (or reset) the connection; never blocks."""
        return closed_by_peer(self.sock, self._poll)

    def close(self) -> None:
        self.sock.close()


def closed_by_peer(sock: socket.socket, poll) -> bool:
    """True once the peer closed (or reset) `sock`; never blocks (`poll`: a
    `select.poll` with `sock` registered for POLLIN | POLLRDHUP, asked first,
    since a socket with a timeout waits for data before any recv)."""
    if sock.fileno() < 0:
        return True
    if not poll.poll(0):
        return False  # nothing to read and no hang-up: open
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


def listen_socket(host: str, port: int, backlog: int = 128) -> tuple[socket.socket, str]:
    """A non-blocking listening TCP socket and the "host:port" it is bound to
    (port 0 picks a free one)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(backlog)
        listener.setblocking(False)
    except BaseException:
        listener.close()
        raise
    bound_host, bound_port = listener.getsockname()[:2]
    return listener, f"{bound_host}:{bound_port}"
