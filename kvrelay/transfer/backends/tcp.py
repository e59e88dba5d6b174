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
import concurrent.futures
import contextlib
import functools
import socket
from reprlib import repr as brief

import numpy as np

from kvrelay.transfer.base import Transport
from kvrelay.transfer.errors import (
    HandleError,
    LeaseExpired,
    MalformedHandle,
    PeerError,
    RunOutOfBounds,
    UnknownArena,
)
from kvrelay.transfer.handle import MAX_RUNS, check_runs
from kvrelay.transfer.wire import error_reply

_REMOTE_ERRORS = {
    cls.__name__: cls for cls in (LeaseExpired, RunOutOfBounds, UnknownArena, MalformedHandle)
}


class TcpTransport(Transport):
    name = "tcp"

    async def move(self, peer, handle, local, triples, read) -> None:
        conn = peer.conn
        # The runs go packed (little-endian uint64 offset, length pairs), as
        # in a handle: a list of 512 pairs cost the owner half a millisecond
        # to check item by item before the first byte moved.
        runs = np.ascontiguousarray(triples[:, [0, 2]], dtype="<u8").tobytes()
        async with conn.lock:
            op = "read" if read else "write"
            await conn.send(
                {"op": op, "arena": handle.arena_id, "lease": handle.lease_id, "runs": runs}
            )
            reply = await conn.recv()
            _raise_refusal(reply, peer.address)
            views = [local.buffer(lo, n) for lo, n in triples[:, 1:].tolist()]
            await move_bytes(conn, views, receive=read)
            if not read:
                _raise_refusal(await conn.recv(), peer.address)

    async def serve(self, agent, conn, message) -> bool:
        op = message.get("op")
        if op not in ("read", "write"):
            return False
        try:
            arena, runs = _checked(agent, message)
        except HandleError as exc:
            await conn.send(error_reply(exc))
            return True
        await conn.send({"ok": True, "nbytes": int(runs[:, 1].sum())})
        views = [arena.buffer(offset, length) for offset, length in runs.tolist()]
        # A writer that announces bytes and stalls must not hold the connection.
        async with asyncio.timeout(agent.config.timeout):
            await move_bytes(conn, views, receive=op == "write")
        if op == "write":
            await conn.send({"ok": True})
        return True


_BULK_BYTES = 1 << 20
_IOV_MAX = 1024  # Linux's limit of buffers per sendmsg/recvmsg
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
    # One sendmsg/recvmsg_into call covers up to _IOV_MAX runs (a 512-run
    # batch is a handful of system calls, not one per run).
    # Blocking, but a call that moves nothing for _STALL_S fails: a peer that
    # stops mid-transfer cannot hold a thread of the pool for ever (the
    # reader's own deadline usually ends it sooner, by shutting the socket).
    sock.settimeout(_STALL_S)
    try:
        pending = [v.cast("B") for v in views if len(v)]
        while pending:
            batch = pending[:_IOV_MAX]
            n = sock.recvmsg_into(batch)[0] if receive else sock.sendmsg(batch)
            if n == 0:
                raise PeerError("the peer closed the connection")
            pending = _advance(batch, n) + pending[_IOV_MAX:]
    except OSError as exc:
        raise PeerError(f"connection lost while moving bytes: {exc}") from None
    finally:
        sock.setblocking(False)


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    """What is left of `views` once their first `n` bytes moved."""
    for i, view in enumerate(views):
        if n < len(view):
            return [view[n:], *views[i + 1 :]]
        n -= len(view)
    return []


def _checked(agent, message):
    arena_id = message.get("arena")
    arena = agent.arenas.get(arena_id) if type(arena_id) is int else None
    if arena is None:
        raise UnknownArena(f"no arena {brief(arena_id)}")
    lease_id = message.get("lease")
    lease = agent.leases.get(lease_id) if type(lease_id) is int else None
    if lease is None or not agent.leases.is_active(lease_id) or lease.arena_id != arena.arena_id:
        raise LeaseExpired(f"lease {brief(lease_id)} is not active on arena {arena.arena_id}")
    runs = message.get("runs")
    if isinstance(runs, bytes):  # packed uint64 pairs, what this backend sends
        if len(runs) % 16 or len(runs) > 16 * MAX_RUNS:
            raise MalformedHandle("packed runs must be 16-byte (offset, length) records")
        runs = np.frombuffer(runs, dtype="<u8").astype(np.uint64).reshape(-1, 2)
    elif not isinstance(runs, list) or not all(
        isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r) for r in runs
    ):
        raise MalformedHandle("runs must be packed uint64 pairs or [offset, length] int pairs")
    if not len(runs):
        raise MalformedHandle("a request names at least one run")
    return arena, check_runs(runs, arena.size, "requested")


def _raise_refusal(reply: dict, address: str) -> None:
    if reply.get("ok"):
        return
    cls = _REMOTE_ERRORS.get(reply.get("error"), PeerError)
    raise cls(f"agent {address} refused: {reply.get('message')}")
