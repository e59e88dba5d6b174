"""Hostile and stale handles are typed errors before any byte moves, against
a real peer process (ucx: cma could read any address of the peer, so these
checks are what keeps reads inside the arena) and the tcp server's own checks."""

import asyncio
import dataclasses
import time

import msgpack
import numpy as np
import pytest

from kvrelay.rpc import WIRE_VERSION, Connection
from kvrelay.transfer import (
    AuthError,
    BlockHandle,
    HandleVersionError,
    LeaseExpired,
    MalformedHandle,
    NamespaceMismatch,
    RkeyMismatch,
    RunOutOfBounds,
    UnknownArena,
    create_agent,
)
from tests.transfer.peer import NAMESPACE, TOKEN

SIZE = 1 << 20


def forge(raw: bytes, **changes) -> bytes:
    return dataclasses.replace(BlockHandle.from_bytes(raw), **changes).to_bytes()


def patch_raw(raw: bytes, **changes) -> bytes:
    fields = msgpack.unpackb(raw)
    fields.update(changes)
    return msgpack.packb(fields, use_bin_type=True)


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["ucx-shm", "tcp"])
async def test_hostile_handles_are_refused_before_any_byte_moves(mode, start_peer):
    peer = start_peer(mode, SIZE, [[(0, 4096)]], lease_seconds=60)
    peer_short = start_peer(mode, SIZE, [[(0, 4096)]], lease_seconds=0.3)
    good = peer.handles[0]
    parsed = BlockHandle.from_bytes(good)
    backend = "ucx" if mode.startswith("ucx") else "tcp"
    cases = [
        (forge(good, runs=((SIZE - 100, 4096),)), RunOutOfBounds),
        (forge(good, runs=((2**63, 4096),)), RunOutOfBounds),
        (forge(good, runs=((0, 0),)), RunOutOfBounds),
        (forge(good, rkey=b"\x01" * max(1, len(parsed.rkey))), RkeyMismatch),
        (forge(good, base=parsed.base - 4096), RkeyMismatch),
        (forge(good, arena_id=99), UnknownArena),
        (forge(good, namespace=b"\x00" * 32), NamespaceMismatch),
        (good[: len(good) // 2], MalformedHandle),
        (b"\xc1", MalformedHandle),
        (patch_raw(good, runs=[[0]]), MalformedHandle),
        (patch_raw(good, base=-1), MalformedHandle),
        (patch_raw(good, v=1), HandleVersionError),
        (patch_raw(good, runs=[[0, 4096]]), MalformedHandle),  # version 1's list form
        (patch_raw(good, runs=b"\x00" * 15), MalformedHandle),
        (forge(good, lease_expiry=time.time() - 1), LeaseExpired),
    ]

    async def check():
        async with await create_agent(backend, token=TOKEN, fast_path=False) as agent:
            local = agent.allocate_arena(SIZE)
            local.tensor.fill_(7)
            for raw, error in cases:
                with pytest.raises(error):
                    await agent.read(raw, local, [0], namespace=NAMESPACE, timeout=10)
            with pytest.raises(RunOutOfBounds):  # local side out of bounds
                await agent.read(good, local, [SIZE - 10], namespace=NAMESPACE, timeout=10)
            assert int(local.tensor.sum()) == 7 * SIZE  # nothing was written
            await asyncio.sleep(0.4)
            with pytest.raises(LeaseExpired):
                await agent.read(peer_short.handles[0], local, [0], namespace=NAMESPACE, timeout=10)
            await agent.read(good, local, [0], namespace=NAMESPACE, timeout=10)  # still fine

        async with await create_agent(backend, token="wrong-token") as stranger:
            local = stranger.allocate_arena(4096)
            with pytest.raises(AuthError):
                await stranger.read(good, local, [0], namespace=NAMESPACE, timeout=10)

    await check()


@pytest.mark.asyncio
async def test_tcp_server_checks_requests_itself(start_peer):
    """A client that skips its own checks still cannot read outside the arena."""
    peer = start_peer("tcp", SIZE, [[(0, 4096)]])
    handle = BlockHandle.from_bytes(peer.handles[0])
    host, port = peer.address.rsplit(":", 1)

    async def raw_requests():
        conn = await Connection.open(host, int(port))
        await conn.send({"op": "hello", "v": WIRE_VERSION, "token": TOKEN})
        assert (await conn.recv())["op"] == "agent"
        base = {"op": "read", "arena": handle.arena_id, "lease": handle.lease_id}
        for request, error in [
            (base | {"runs": np.array([SIZE - 1, 2], "<u8").tobytes()}, "RunOutOfBounds"),
            (base | {"runs": np.array([0, 16], "<u8").tobytes(), "lease": 12345}, "LeaseExpired"),
            (base | {"runs": np.array([0, 16], "<u8").tobytes(), "arena": 42}, "UnknownArena"),
            (base | {"runs": "all"}, "MalformedMessage"),  # runs travel packed, nothing else
            (base | {"runs": [[0, 16]]}, "MalformedMessage"),
            (base | {"op": "nope"}, "MalformedMessage"),
            (base | {"runs": b"\x00" * 15}, "MalformedHandle"),  # not 16-byte records
            (base | {"runs": np.array([SIZE, 1], "<u8").tobytes()}, "RunOutOfBounds"),
            (base | {"runs": np.array([0, 0], "<u8").tobytes()}, "RunOutOfBounds"),  # empty
        ]:
            await conn.send(request)
            reply = await conn.recv()
            assert reply["op"] == "error" and reply["error"] == error, reply
        conn.close()

        async with await create_agent("tcp", token=TOKEN) as agent:
            local = agent.allocate_arena(4096)
            await agent.read(handle, local, [0], namespace=NAMESPACE, timeout=10)
            await agent.release_remote(handle)
            with pytest.raises(LeaseExpired):  # released: the owner refuses it
                await agent.read(handle, local, [0], namespace=NAMESPACE, timeout=10)

    await raw_requests()
