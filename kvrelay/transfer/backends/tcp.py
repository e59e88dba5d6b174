"""Pure asyncio backend: the control connection also carries page bytes.

A read is one frame naming the arena, lease and runs; the owner checks them
all, answers with the byte count, then sends the runs straight out of its
arena, and the reader receives them straight into its arena (no staging
copies on either side). A write is announced the same way and sent only
after the owner accepted it.

Bytes move on a worker thread per side with the socket in blocking mode:
the reader sends its request from the event loop and its thread reads the
owner's answer and receives the runs; the owner's loop sends the answer and
the first MiB of the runs in one non-blocking `writev`, and its thread sends
the rest. Past its answer the owner cannot refuse in a frame (it would land
among the bytes): on any failure it shuts the connection down. Through the
event loop every socket-buffer-sized chunk cost a wake-up and a callback,
and the hops
between loop and thread around the answer cost a pull of 32 MiB a fifth of
its time (see docs/architecture.md, "Where a pull's time goes"). The runs
travel as a C `iovec` array built by numpy, handed to `readv` / `writev`
(ctypes, the GIL released): no Python object per run. A deadline or
cancellation shuts the socket down, which ends the blocked call at once, and
waits for the thread, so nothing touches the arena afterwards.

A pull of STRIPE_MIN_BYTES or more, where this process may run on two
CPUs, goes half on the control connection and half on a second connection
to the same agent (opened on first use, past the same hello, closed with
the peer), both at once: each half is a request of its own, checked by the
owner like any other.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import errno
import functools
import os
import socket
import struct

import numpy as np

from kvrelay import rpc
from kvrelay.rpc.agent_ops import Accepted, AgentWelcome, Read, Write
from kvrelay.rpc.framing import FRAME_HEADER, MAX_FRAME, decode, framed
from kvrelay.rpc.messages import Error
from kvrelay.transfer.base import Transport
from kvrelay.transfer.errors import (
    LeaseExpired,
    MalformedHandle,
    PeerError,
    ProtocolError,
    RunOutOfBounds,
    UnknownArena,
)
from kvrelay.transfer.handle import MAX_RUNS, check_runs, rows_array
from kvrelay.transfer.lease import covers
from kvrelay.transfer.stripes import STRIPE_MIN_BYTES, split_rows, two_cpus

_REMOTE_ERRORS = {
    cls.__name__: cls for cls in (LeaseExpired, RunOutOfBounds, UnknownArena, MalformedHandle)
}
_IOV_MAX = 1024  # Linux's limit of buffers per readv/writev
# A blocked call that moves nothing for this long fails (SO_RCVTIMEO /
# SO_SNDTIMEO): a peer that stops mid-transfer cannot hold a thread of the
# pool for ever (the caller's own deadline usually ends it sooner).
_STALL_S = 30.0
# What the owner's event loop sends itself, with its answer, before its
# thread takes over (a copy of about 0.2 ms: the loop is not held long).
_INLINE_BYTES = 1 << 20

_libc = ctypes.CDLL(None, use_errno=True)
for _call_name in ("readv", "writev"):
    getattr(_libc, _call_name).argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    getattr(_libc, _call_name).restype = ctypes.c_ssize_t


class TcpTransport(Transport):
    name = "tcp"
    lease_bounded = True

    def __init__(self) -> None:
        self.stripes = 1  # set by tune()
        self._config = None
        self._seconds: set[rpc.Connection] = set()  # peers' second connections

    def tune(self, config, plan) -> None:
        self._config = config
        self.stripes = (config.stripes or 2) if two_cpus() else 1

    async def move(self, peer, handle, local, rows, read, deadline) -> None:
        triples = rows_array(rows)
        halves = split_rows(triples, STRIPE_MIN_BYTES, read) if self.stripes > 1 else None
        async with asyncio.timeout_at(deadline):
            if halves is None:
                await self._move(peer.conn, peer, handle, local, triples, read)
                return
            # Half on the control connection, half on a second one, at once:
            # one loopback stream is bound by its two threads (two moved
            # 1.25-1.3x one here). Both run to their end (a refusal of one
            # half is the other's too); a deadline cancels both.
            second = await self._second_connection(peer)
            halves_moved = await asyncio.gather(
                self._move(peer.conn, peer, handle, local, halves[0], read),
                self._move(second, peer, handle, local, halves[1], read),
                return_exceptions=True,
            )
            for outcome in halves_moved:
                if isinstance(outcome, BaseException):
                    raise outcome

    async def _second_connection(self, peer) -> rpc.Connection:
        """The peer's second connection (opened on first use, past the hello)."""
        conn = peer.state
        if conn is None or conn.closed_by_peer():
            if conn is not None:
                self.drop_peer(peer)
            token, timeout = self._config.token, self._config.timeout
            conn, hello = await rpc.connect(peer.address, token, AgentWelcome, timeout)
            if hello.agent_id != peer.agent_id:
                conn.close()
                raise PeerError(f"agent {peer.address} restarted")
            if peer.state is not None:  # another pull connected meanwhile: keep the first
                conn.close()
                return peer.state
            peer.state = conn
            self._seconds.add(conn)
        return conn

    def drop_peer(self, peer) -> None:
        if peer.state is not None:
            peer.state.close()
            self._seconds.discard(peer.state)
            peer.state = None

    def stats(self) -> dict:
        return {"tcp_stripes": self.stripes, "tcp_second_connections": len(self._seconds)}

    async def _move(self, conn, peer, handle, local, triples, read) -> None:
        # The runs go packed (little-endian uint64 offset, length pairs), as
        # in a handle: a list of 512 pairs cost the owner half a millisecond
        # to check item by item before the first byte moved.
        runs = np.ascontiguousarray(triples[:, [0, 2]], dtype="<u8").tobytes()
        request = (Read if read else Write)(handle.arena_id, handle.lease_id, runs)
        # The bytes arrive as one stream: runs adjacent here take one iovec.
        iov = iovecs(local, merge_adjacent(triples[:, 1:]))
        nbytes = int(triples[:, 2].sum())
        async with conn.lock:
            # No deadline of its own: move's covers the whole of it.
            try:
                # Sent from the loop (a small frame leaves at once): the
                # owner works on it while the worker thread wakes up.
                await conn.send(request)
                await in_thread(conn.sock, _answer_and_move, nbytes, iov, read)
                if not read:
                    await rpc.answer(conn, rpc.Ok)
            except rpc.RemoteError as exc:
                cls = _REMOTE_ERRORS.get(exc.error, PeerError)
                raise cls(f"agent {peer.address} refused: {exc.remote_message}") from exc

    async def serve(self, agent, conn, request):
        if not isinstance(request, Read | Write):
            return await super().serve(agent, conn, request)
        arena, runs = _checked(agent, request, conn.scope)  # refused with its HandleError's name
        iov = iovecs(arena, merge_adjacent(runs))
        answer = Accepted(int(runs[:, 1].sum()))
        receive = isinstance(request, Write)
        try:
            # A writer that announces bytes and stalls must not hold the connection.
            async with asyncio.timeout(agent.config.timeout):
                if receive:
                    await conn.send(answer)
                    await in_thread(conn.sock, move_iovecs, iov, True)
                    return rpc.Ok()
                # The answer and the first bytes leave in one call from the
                # loop, so the bytes flow while this side's thread wakes up.
                head = np.frombuffer(framed(answer), dtype=np.uint8)
                rest = send_some(conn.sock, head, iov, _INLINE_BYTES)
                if len(rest):
                    await in_thread(conn.sock, move_iovecs, rest, False)
                del head  # alive until here: `rest` may point into it
        except BaseException:
            # Past the answer the stream is mid-transfer: a typed Error frame
            # would land among the other side's bytes, which would then wait
            # for its deadline. Shut the connection down: it fails at once.
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
            raise
        return None


def merge_adjacent(runs: np.ndarray) -> np.ndarray:
    """(k, 2) uint64 (offset, length) rows with each run that continues the
    one before it joined to it, in order (what one stream of bytes fills or
    drains)."""
    offsets = np.asarray(runs[:, 0], dtype=np.uint64)
    lengths = np.asarray(runs[:, 1], dtype=np.uint64)
    if not len(offsets):
        return np.empty((0, 2), dtype=np.uint64)
    starts = np.ones(len(offsets), dtype=bool)
    starts[1:] = offsets[1:] != offsets[:-1] + lengths[:-1]
    first = np.flatnonzero(starts)
    return np.stack([offsets[first], np.add.reduceat(lengths, first)], axis=1)


def iovecs(arena, ranges: np.ndarray) -> np.ndarray:
    """A C `struct iovec` array (rows of uint64 address, length) for the
    (offset, length) `ranges` of a host arena, checked against its bounds."""
    if arena.is_cuda or arena.closed:
        raise ValueError(f"arena {arena.arena_id} has no host memory to move")
    ends = ranges[:, 0] + ranges[:, 1]
    # Both sides checked their runs already; this keeps the raw pointers
    # honest whoever calls it.
    if len(ranges) and (int(ends.max()) > arena.size or bool((ends < ranges[:, 0]).any())):
        raise RunOutOfBounds(f"runs outside arena {arena.arena_id} of {arena.size} bytes")
    iov = np.empty((len(ranges), 2), dtype=np.uint64)
    iov[:, 0] = ranges[:, 0] + np.uint64(arena.address)
    iov[:, 1] = ranges[:, 1]
    return iov


@functools.cache
def _pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvrelay-tcp")


async def in_thread(sock: socket.socket, fn, *args) -> None:
    """`fn(sock, *args)` on a pool thread with `sock` blocking. On
    cancellation (a deadline, a cancelled caller) the socket is shut down,
    which ends a blocked call at once, and the thread waited for: nothing
    touches the arena after this returns."""
    job = _pool().submit(_blocking, sock, fn, *args)
    try:
        await asyncio.wrap_future(job)
    except asyncio.CancelledError:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        concurrent.futures.wait([job])
        raise


def _blocking(sock: socket.socket, fn, *args) -> None:
    stall = struct.pack("ll", int(_STALL_S), int(_STALL_S % 1 * 1e6))  # a struct timeval
    try:
        sock.setblocking(True)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, stall)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, stall)
        fn(sock, *args)
    except OSError as exc:
        raise PeerError(f"connection lost while moving bytes: {exc}") from None
    finally:
        with contextlib.suppress(OSError):  # shut down or closed meanwhile
            none = struct.pack("ll", 0, 0)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, none)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, none)
            sock.setblocking(False)


def _answer_and_move(sock, nbytes: int, iov: np.ndarray, read: bool) -> None:
    """The reader's (or writer's) side, after its request: the owner's answer, the bytes."""
    answer = decode(_recv_frame(sock), Accepted | Error)
    if isinstance(answer, Error):
        raise answer.exception()
    if answer.nbytes != nbytes:
        raise PeerError(f"the owner accepted {answer.nbytes} bytes, the request has {nbytes}")
    move_iovecs(sock, iov, receive=read)


def _recv_frame(sock: socket.socket) -> bytes:
    header = _recv_exactly(sock, FRAME_HEADER.size)
    (length,) = FRAME_HEADER.unpack(header)
    if length > MAX_FRAME:
        raise ProtocolError(f"frame of {length} bytes exceeds {MAX_FRAME}")
    return _recv_exactly(sock, length)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray(n)
    view, got = memoryview(data), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise PeerError("the peer closed the connection")
        got += k
    return bytes(data)


def send_some(sock: socket.socket, head: np.ndarray, iov: np.ndarray, limit: int) -> np.ndarray:
    """On the event loop (the socket non-blocking): `head`'s bytes, then at
    most `limit` bytes of the buffers of `iov`, in one `writev` that sends
    what the socket takes now. Returns the rows still to send (advanced past
    what went; they may point into `head`)."""
    rows = np.empty((len(iov) + 1, 2), dtype=np.uint64)
    rows[0] = (head.ctypes.data, head.nbytes)
    rows[1:] = iov
    ends = np.cumsum(rows[:, 1])
    want = min(int(ends[-1]), head.nbytes + limit)
    count = min(int(np.searchsorted(ends, want, side="left")) + 1, _IOV_MAX)
    prefix = rows[:count].copy()
    prefix[-1, 1] -= np.uint64(max(0, int(ends[count - 1]) - want))
    n = _libc.writev(sock.fileno(), prefix.ctypes.data, count)
    if n < 0:
        err = ctypes.get_errno()
        if err not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
            raise PeerError(f"connection lost while sending: {os.strerror(err)}")
        n = 0
    return rows[_advance(rows, ends, 0, n) :]


def move_iovecs(sock: socket.socket, iov: np.ndarray, receive: bool) -> None:
    """`readv` into (or `writev` from) every buffer of `iov` in order, on a
    blocking socket. `iov` is consumed (its rows advanced)."""
    call = _libc.readv if receive else _libc.writev
    ends = np.cumsum(iov[:, 1])
    first, done, fd = 0, 0, sock.fileno()
    while first < len(iov):
        n = call(fd, iov.ctypes.data + iov.itemsize * 2 * first, min(len(iov) - first, _IOV_MAX))
        if n < 0:
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            if err in (errno.EAGAIN, errno.EWOULDBLOCK):
                raise PeerError(f"the peer moved no byte for {_STALL_S:g} s")
            raise PeerError(f"connection lost while moving bytes: {os.strerror(err)}")
        if n == 0:
            raise PeerError("the peer closed the connection")
        done += n
        first = _advance(iov, ends, first, done)


def _advance(iov: np.ndarray, ends: np.ndarray, first: int, done: int) -> int:
    """The index of the first buffer not yet full after `done` bytes, with
    its row moved past the bytes already done."""
    first = int(np.searchsorted(ends, done, side="right"))
    if first < len(iov):
        left = int(ends[first]) - done
        iov[first, 0] += iov[first, 1] - np.uint64(left)
        iov[first, 1] = left
    return first


def _checked(agent, request, scope):
    arena = agent.arenas.get(request.arena)
    if arena is None:
        raise UnknownArena(f"no arena {request.arena!r}")
    lease = agent.leases.get(request.lease)
    if (
        lease is None
        or not agent.leases.is_active(request.lease)
        or lease.arena_id != arena.arena_id
        # A tenant-scoped peer's leases are its namespace's; another's answer
        # as unknown, so that a guess learns nothing.
        or not scope.allows(lease.namespace)
    ):
        raise LeaseExpired(f"lease {request.lease!r} is not active on arena {arena.arena_id}")
    runs = request.runs  # packed uint64 (offset, length) pairs
    if not runs or len(runs) % 16 or len(runs) > 16 * MAX_RUNS:
        raise MalformedHandle("packed runs must be 16-byte (offset, length) records, one or more")
    runs = np.frombuffer(runs, dtype="<u8").astype(np.uint64).reshape(-1, 2)
    runs = check_runs(runs, arena.size, "requested")
    # The lease is the capability: a holder reads (or writes) the pages it
    # was given, never the rest of the arena (another tenant's pages).
    if not covers(lease, runs):
        raise RunOutOfBounds(f"requested runs lie outside lease {request.lease!r}'s pages")
    return arena, runs
