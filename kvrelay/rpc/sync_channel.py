"""A blocking `Channel` for a caller on a thread of its own.

An engine calls its cache backend from its own threads; a call that hops to
the backend's event loop and back pays two thread wake-ups, and on a small
VM an idle thread's wake-up costs 0.1-0.3 ms (an idle vCPU halts). Calls
made on the caller's thread over a socket of their own pay only the
server's. Same frames, hello and pairing of posted replies as `Channel`; a
lock serialises the threads that share one. Every failure (no connection,
deadline, refusal, a broken frame) raises `Unavailable` and closes the
socket: the next call reconnects.
"""

from __future__ import annotations

import collections
import contextlib
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from kvrelay.rpc.channel import Unavailable
from kvrelay.rpc.errors import MalformedMessage, PeerError, RemoteError, RpcError, RpcTimeout
from kvrelay.rpc.framing import (
    FRAME_HEADER,
    MAX_FRAME,
    closed_by_peer,
    decode,
    framed,
    split_address,
)
from kvrelay.rpc.messages import WIRE_VERSION, Error, Hello, Message

R = TypeVar("R", bound=Message)


class SyncChannel:
    def __init__(
        self,
        address: str,
        token: str,
        welcome: type[Message],
        timeout_s: float,
        check: Callable[[Message], str | None] | None = None,
    ) -> None:
        self.address, self.token, self.welcome = address, token, welcome
        self.timeout_s = timeout_s
        self.check = check  # what is wrong with a welcome, None when it is fine
        self.lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._poll = None  # a poll of the socket, for its hang-up (`closed_by_peer`)
        self.welcome_reply: Message | None = None  # the server's welcome, once connected
        self._posted: collections.deque[type[Message]] = collections.deque()

    def call(self, request: Message, reply: type[R]) -> R:
        """`request`'s reply, within `timeout_s` for the whole call (connecting too)."""
        deadline = time.monotonic() + self.timeout_s
        with self._held(deadline):
            try:
                sock = self._socket(deadline)
                self._drain_posted(sock, deadline)
                _send(sock, request, deadline)
                return _answer(sock, reply, deadline)
            except RemoteError as exc:
                raise Unavailable(f"{self.address} refused: {exc}") from exc
            except (RpcError, OSError) as exc:
                self.close()
                raise Unavailable(f"{self.address}: {exc!r}") from exc

    def post(self, request: Message, reply: type[Message]) -> bool:
        """Send `request` without waiting for its reply (read and dropped before
        the next call's); False when it was not sent (best effort)."""
        deadline = time.monotonic() + self.timeout_s
        try:
            with self._held(deadline):
                if self._sock is None:
                    return False
                try:
                    _send(self._sock, request, deadline)
                except (RpcError, OSError):
                    self.close()
                    return False
                self._posted.append(reply)
                return True
        except Unavailable:
            return False

    def settle(self) -> None:
        """Read the answers of the posted requests now (the server has then
        handled them); a failure closes the socket, as in `call`."""
        deadline = time.monotonic() + self.timeout_s
        with contextlib.suppress(Unavailable), self._held(deadline):
            if self._sock is None:
                return
            try:
                self._drain_posted(self._sock, deadline)
            except (RpcError, OSError):
                self.close()

    def close(self) -> None:
        self._posted.clear()  # their replies went with the socket
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None

    @contextlib.contextmanager
    def _held(self, deadline: float):
        if not self.lock.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            raise Unavailable(f"{self.address}: another thread held the channel past the deadline")
        try:
            yield
        finally:
            self.lock.release()

    def _socket(self, deadline: float) -> socket.socket:
        if self._sock is not None and closed_by_peer(self._sock, self._poll):
            self.close()  # a restarted server: reconnect rather than fail
        if self._sock is None:
            host, port = split_address(self.address)
            sock = socket.create_connection((host, port), timeout=_left(deadline))
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                _send(sock, Hello(v=WIRE_VERSION, token=self.token), deadline)
                welcome = _answer(sock, self.welcome, deadline)
            except BaseException:
                sock.close()
                raise
            problem = self.check(welcome) if self.check is not None else None
            if problem:
                sock.close()
                raise Unavailable(f"{self.address}: {problem}")
            self._sock, self.welcome_reply = sock, welcome
            self._poll = select.poll()
            self._poll.register(sock, select.POLLIN | select.POLLRDHUP)
        return self._sock

    def connect(self) -> Message:
        """Connect now if not connected; the server's welcome."""
        deadline = time.monotonic() + self.timeout_s
        with self._held(deadline):
            try:
                self._socket(deadline)
            except (RpcError, OSError) as exc:
                self.close()
                raise Unavailable(f"{self.address}: {exc!r}") from exc
        return self.welcome_reply

    def _drain_posted(self, sock: socket.socket, deadline: float) -> None:
        while self._posted:
            kind = self._posted.popleft()
            with contextlib.suppress(RemoteError):  # a refused post: nobody waits for it
                _answer(sock, kind, deadline)


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise RpcTimeout("the call passed its deadline")
    return left


def _send(sock: socket.socket, message: Message, deadline: float) -> None:
    sock.settimeout(_left(deadline))
    sock.sendall(framed(message))


def _recv_exact(sock: socket.socket, size: int, deadline: float) -> bytes:
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        sock.settimeout(_left(deadline))
        n = sock.recv_into(view[got:])
        if n == 0:
            raise PeerError("the peer closed the connection")
        got += n
    return bytes(buf)


def _answer(sock: socket.socket, reply: type[R], deadline: float) -> R:
    """The next frame as `reply`; an `Error` reply raises its exception."""
    (length,) = FRAME_HEADER.unpack(_recv_exact(sock, FRAME_HEADER.size, deadline))
    if length > MAX_FRAME:
        raise PeerError(f"frame of {length} bytes exceeds {MAX_FRAME}")
    try:
        message = decode(_recv_exact(sock, length, deadline), reply | Error)
    except MalformedMessage as exc:
        raise PeerError(f"an answer of the wrong shape: {exc}") from exc
    if isinstance(message, Error):
        raise message.exception()
    return message
