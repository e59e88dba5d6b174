"""Pure asyncio backend: the control connection also carries page bytes.

A read is one frame naming the arena, lease and runs; the owner checks them
all, answers with the byte count, then sends the runs straight out of its
arena, and the reader receives them straight into its arena (no staging
copies on either side). A write is announced the same way and sent only
after the owner accepted it.

Bulk bytes (a megabyte or more) move on a worker thread with the socket in
blocking mode, one `sendall`/`recv_into` loop over all runs with the GIL
released in each call: through the event loop every socket-buffer-sized
chunk cost a wake-up and a callback, and a 512-run batch ran at about half
of loopback TCP's speed. A deadline or cancellation shuts the socket down,
which ends the blocked call at once, and waits for the thread, so nothing
touches the arena afterwards.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import socket

import numpy as np

from kvrelay import rpc
from kvrelay.rpc.agent_ops import Accepted, Read, Write
from kvrelay.transfer.base import Transport
from kvrelay.transfer.errors import (
    LeaseExpired,
    MalformedHandle,
    PeerError,
    RunOutOfBounds,
    UnknownArena,
)
from kvrelay.transfer.handle import MAX_RUNS, check_runs
from kvrelay.transfer.lease import covers

_REMOTE_ERRORS = {
    cls.__name__: cls for cls in (LeaseExpired, RunOutOfBounds, UnknownArena, MalformedHandle)
}


class TcpTransport(Transport):
    name = "tcp"

    async def move(self, peer, handle, local, triples, read, deadline) -> None:
        async with asyncio.timeout_at(deadline):
            await self._move(peer, handle, local, triples, read)

    async def _move(self, peer, handle, local, triples, read) -> None:
        conn = peer.conn
        # The runs go packed (little-endian uint64 offset, length pairs), as
        # in a handle: a list of 512 pairs cost the owner half a millisecond
        # to check item by item before the first byte moved.
        runs = np.ascontiguousarray(triples[:, [0, 2]], dtype="<u8").tobytes()
        request = (Read if read else Write)(handle.arena_id, handle.lease_id, runs)
        async with conn.lock:
            # No deadline of its own: move's covers the whole of it.
            await _call(conn, request, Accepted, peer.address)
            # The bytes arrive as one stream: runs adjacent here take one buffer.
            views = [local.buffer(lo, n) for lo, n in merge_adjacent(triples[:, 1:])]
            await move_bytes(conn, views, receive=read)
            if not read:
                await _call(conn, None, rpc.Ok, peer.address)

    async def serve(self, agent, conn, request):
        if not isinstance(request, Read | Write):
            return await super().serve(agent, conn, request)
        arena, runs = _checked(agent, request)  # refused with its HandleError's name
        await conn.send(Accepted(int(runs[:, 1].sum())))
        views = [arena.buffer(offset, length) for offset, length in merge_adjacent(runs)]
        # A writer that announces bytes and stalls must not hold the connection.
        async with asyncio.timeout(agent.config.timeout):
            await move_bytes(conn, views, receive=isinstance(request, Write))
        return rpc.Ok() if isinstance(request, Write) else None


_BULK_BYTES = 1 << 20
_IOV_MAX = 1024  # Linux's limit of buffers per sendmsg/recvmsg
_WINDOW_BYTES = 8 << 20  # more than a loopback socket buffer here (4 MiB)
_STALL_S = 30.0


@functools.cache
def _bulk_pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvrelay-tcp")


async def move_bytes(conn, views: list[memoryview], receive: bool) -> None:
    """Sends or receives `views` in order on the connection's socket."""
    if sum(len(v) for v in views) < _BULK_BYTES:
        for view in views:
            await (conn.recv_into(view) if receive else conn.send_bytes(view))
        return
    sock = conn.sock
    job = _bulk_pool().submit(_blocking_move, sock, views, receive)
    try:
        await asyncio.wrap_future(job)
    except asyncio.CancelledError:
        # A deadline or a cancelled caller: end the blocked call, then wait
        # for the thread so that nothing writes into the views after this.
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        concurrent.futures.wait([job])
        raise


def _blocking_move(sock: socket.socket, views: list[memoryview], receive: bool) -> None:
    # One sendmsg/recvmsg_into call covers a window of runs of about a socket
    # buffer (a 512-run batch is tens of system calls, not one per run). A
    # call moves at most what the socket buffer holds, so handing each one
    # every run left (up to _IOV_MAX) cost O(runs) buffer lookups per call:
    # O(runs^2) per batch, about as long as the transfer itself for 512 runs.
    # Blocking, but a call that moves nothing for _STALL_S fails: a peer that
    # stops mid-transfer cannot hold a thread of the pool for ever (the
    # reader's own deadline usually ends it sooner, by shutting the socket).
    sock.settimeout(_STALL_S)
    try:
        pending = collections.deque(v.cast("B") for v in views if len(v))
        while pending:
            window = _window(pending)
            n = sock.recvmsg_into(window)[0] if receive else sock.sendmsg(window)
            if n == 0:
                raise PeerError("the peer closed the connection")
            _consume(pending, n)
    except OSError as exc:
        raise PeerError(f"connection lost while moving bytes: {exc}") from None
    finally:
        sock.setblocking(False)


def _window(pending: collections.deque) -> list[memoryview]:
    """The first views of `pending`, up to _WINDOW_BYTES (at least one view)."""
    window, size = [], 0
    for view in pending:
        window.append(view)
        size += len(view)
        if size >= _WINDOW_BYTES or len(window) == _IOV_MAX:
            break
    return window


def _consume(pending: collections.deque, n: int) -> None:
    """Drops the first `n` bytes of `pending`."""
    while n:
        view = pending[0]
        if n < len(view):
            pending[0] = view[n:]
            return
        n -= len(view)
        pending.popleft()


def merge_adjacent(runs: np.ndarray) -> list[tuple[int, int]]:
    """(offset, length) rows with each run that continues the one before it
    joined to it, in order (what one stream of bytes fills or drains)."""
    offsets = np.asarray(runs[:, 0], dtype=np.uint64)
    lengths = np.asarray(runs[:, 1], dtype=np.uint64)
    if not len(offsets):
        return []
    starts = np.ones(len(offsets), dtype=bool)
    starts[1:] = offsets[1:] != offsets[:-1] + lengths[:-1]
    first = np.flatnonzero(starts)
    return list(zip(offsets[first].tolist(), np.add.reduceat(lengths, first).tolist(), strict=True))


def _checked(agent, request):
    arena = agent.arenas.get(request.arena)
    if arena is None:
        raise UnknownArena(f"no arena {request.arena!r}")
    lease = agent.leases.get(request.lease)
    if (
        lease is None
        or not agent.leases.is_active(request.lease)
        or lease.arena_id != arena.arena_id
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


async def _call(conn, request, reply, address: str):
    """Sends `request` (None: only reads the reply); a refusal raises the
    owner's error class where the reader knows it."""
    try:
        if request is None:
            return await rpc.answer(conn, reply)
        return await rpc.call(conn, request, reply, None)
    except rpc.RemoteError as exc:
        cls = _REMOTE_ERRORS.get(exc.error, PeerError)
        raise cls(f"agent {address} refused: {exc.remote_message}") from exc
