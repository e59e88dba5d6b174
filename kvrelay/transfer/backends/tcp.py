"""Pure asyncio backend: the control connection also carries page bytes.

A read is one frame naming the arena, lease and runs; the owner checks them
all, answers with the byte count, then sends the runs straight out of its
arena, and the reader receives them straight into its arena (no staging
copies on either side). A write is announced the same way and sent only
after the owner accepted it.
"""

from __future__ import annotations

from kvrelay.transfer.base import Transport
from kvrelay.transfer.errors import (
    HandleError,
    LeaseExpired,
    MalformedHandle,
    PeerError,
    RunOutOfBounds,
    UnknownArena,
)
from kvrelay.transfer.handle import check_runs
from kvrelay.transfer.wire import error_reply

_REMOTE_ERRORS = {
    cls.__name__: cls for cls in (LeaseExpired, RunOutOfBounds, UnknownArena, MalformedHandle)
}


class TcpTransport(Transport):
    name = "tcp"

    async def move(self, peer, handle, local, triples, read) -> None:
        conn = peer.conn
        triples = triples.tolist()
        runs = [[r, n] for r, _, n in triples]
        async with conn.lock:
            op = "read" if read else "write"
            await conn.send(
                {"op": op, "arena": handle.arena_id, "lease": handle.lease_id, "runs": runs}
            )
            reply = await conn.recv()
            _raise_refusal(reply, peer.address)
            if read:
                for _, lo, n in triples:
                    await conn.recv_into(local.buffer(lo, n))
            else:
                for _, lo, n in triples:
                    await conn.send_bytes(local.buffer(lo, n))
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
        await conn.send({"ok": True, "nbytes": sum(n for _, n in runs)})
        for offset, length in runs:
            view = arena.buffer(offset, length)
            await (conn.send_bytes(view) if op == "read" else conn.recv_into(view))
        if op == "write":
            await conn.send({"ok": True})
        return True


def _checked(agent, message):
    arena = agent.arenas.get(message.get("arena"))
    if arena is None:
        raise UnknownArena(f"no arena {message.get('arena')!r}")
    lease_id = message.get("lease")
    lease = agent.leases.get(lease_id) if isinstance(lease_id, int) else None
    if lease is None or not agent.leases.is_active(lease_id) or lease.arena_id != arena.arena_id:
        raise LeaseExpired(f"lease {lease_id!r} is not active on arena {arena.arena_id}")
    runs = message.get("runs")
    if not isinstance(runs, list) or not all(
        isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r) for r in runs
    ):
        raise MalformedHandle("runs must be a list of [offset, length] integer pairs")
    check_runs(runs, arena.size, "requested")
    return arena, runs


def _raise_refusal(reply: dict, address: str) -> None:
    if reply.get("ok"):
        return
    cls = _REMOTE_ERRORS.get(reply.get("error"), PeerError)
    raise cls(f"agent {address} refused: {reply.get('message')}")
