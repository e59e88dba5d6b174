"""Control frames: 4-byte big-endian length + a msgpack map, over a raw socket.

The same connection carries raw page bytes for the tcp backend right after a
frame that announces them, received straight into the destination arena.
Frames are bounded (`MAX_FRAME`); anything malformed is a `ProtocolError`.
No pickle: msgpack only, and only plain types.
"""

from __future__ import annotations

import asyncio
import hmac
import socket
import struct

import msgpack

from kvrelay.transfer.errors import PeerError, ProtocolError, TransferError

WIRE_VERSION = 1
MAX_FRAME = 16 << 20  # a read of 2**20 runs needs about 10 MiB of msgpack
# Before the hello nobody is authenticated: a stranger's frame is small, so
# it cannot make the server allocate (and unpack) megabytes.
MAX_HELLO_FRAME = 64 << 10
_LEN = struct.Struct(">I")


class Connection:
    """One control connection on a non-blocking socket, used by one task at a time."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.lock = asyncio.Lock()

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, (host, port))
        except OSError as exc:
            sock.close()
            raise PeerError(f"cannot connect to agent {host}:{port}: {exc}") from None
        return cls(sock)

    async def send(self, message: dict) -> None:
        body = msgpack.packb(message, use_bin_type=True)
        if len(body) > MAX_FRAME:
            raise ProtocolError(f"frame of {len(body)} bytes exceeds {MAX_FRAME}")
        await self.send_bytes(_LEN.pack(len(body)) + body)

    async def recv(self, max_size: int = MAX_FRAME, stall_timeout: float | None = None) -> dict:
        """The next frame. The wait for its first byte is the caller's; once it
        started, the rest must arrive within `stall_timeout` (a peer sending a
        byte a second must not hold the connection)."""
        header = bytearray(_LEN.size)
        await self.recv_into(memoryview(header)[:1])
        async with asyncio.timeout(stall_timeout):
            await self.recv_into(memoryview(header)[1:])
            (length,) = _LEN.unpack(header)
            if length > max_size:
                raise ProtocolError(f"frame of {length} bytes exceeds {max_size}")
            body = bytearray(length)
            await self.recv_into(memoryview(body))
        try:
            message = msgpack.unpackb(bytes(body), raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several unrelated types
            raise ProtocolError(f"frame is not valid msgpack: {exc}") from None
        if not isinstance(message, dict):
            raise ProtocolError("frame is not a msgpack map")
        return message

    async def send_bytes(self, data) -> None:
        try:
            await self.loop.sock_sendall(self.sock, data)
        except OSError as exc:
            raise PeerError(f"connection lost while sending: {exc}") from None

    async def recv_into(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            try:
                n = await self.loop.sock_recv_into(self.sock, view[got:])
            except OSError as exc:
                raise PeerError(f"connection lost while receiving: {exc}") from None
            if n == 0:
                raise PeerError("the peer closed the connection")
            got += n

    def closed_by_peer(self) -> bool:
        """True once the peer closed (or reset) the connection; never blocks."""
        try:
            return self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True

    def close(self) -> None:
        self.sock.close()


def listen_socket(host: str, port: int, backlog: int = 64) -> tuple[socket.socket, str]:
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


def token_ok(given, expected: str) -> bool:
    return isinstance(given, str) and hmac.compare_digest(given.encode(), expected.encode())


def error_reply(exc: Exception) -> dict:
    return {"ok": False, "error": type(exc).__name__, "message": str(exc)[:2000]}


async def refuse(conn: Connection, exc: Exception) -> None:
    """Best effort: tell a peer that spoke garbage why it is dropped."""
    try:
        async with asyncio.timeout(1.0):
            await conn.send(error_reply(exc))
    except (TransferError, TimeoutError, OSError):
        pass
