"""The loopback backend (in-process, a full peer: control server, hello,
arena table) and the backend registry."""

import asyncio
import hashlib

import pytest
import torch

from kvrelay.transfer import (
    AuthError,
    BlockHandle,
    LeaseExpired,
    NamespaceMismatch,
    PeerError,
    RunOutOfBounds,
    TransferError,
    create_agent,
    make_transport,
)

NS = hashlib.sha256(b"ns").digest()


@pytest.mark.parametrize("fast_path", [False, True], ids=["memmove", "fast-path"])
@pytest.mark.asyncio
async def test_loopback_reads_and_writes_batches(fast_path):
    async def main():
        owner = await create_agent("loopback", token="t", fast_path=fast_path)
        reader = await create_agent("loopback", token="t", fast_path=fast_path)
        arena = owner.allocate_arena(1 << 16)
        arena.tensor.copy_(torch.arange(1 << 16, dtype=torch.int64).to(torch.uint8))
        runs = [(4096, 100), (4196, 50), (0, 10)]
        handle = owner.publish(arena, runs, NS, lease_seconds=30)
        local = reader.allocate_arena(4096)
        await reader.read(handle.to_bytes(), local, [0, 100, 1000], namespace=NS)
        assert torch.equal(local.tensor[:150], arena.tensor[4096:4246])
        assert torch.equal(local.tensor[1000:1010], arena.tensor[:10])
        local.tensor.fill_(9)
        await reader.write(handle, local, [0, 100, 1000], namespace=NS)
        assert int(arena.tensor[4096:4246].sum()) == 9 * 150
        with pytest.raises(NamespaceMismatch):
            await reader.read(handle, local, [0, 100, 1000], namespace=b"\x01" * 32)
        with pytest.raises(RunOutOfBounds):
            owner.publish(arena, [(1 << 16, 1)], NS)
        await reader.release_remote(handle)
        assert len(owner.leases) == 0
        expired = owner.publish(arena, runs, NS, lease_seconds=0.01)
        await asyncio.sleep(0.05)
        with pytest.raises(LeaseExpired):
            await reader.read(expired, local, [0, 100, 1000], namespace=NS)
        stranger = await create_agent("loopback", token="other")
        with pytest.raises(AuthError):
            await stranger.read(handle, local, [0, 100, 1000], namespace=NS)
        held = owner.publish(arena, runs, NS, lease_seconds=30)
        with pytest.raises(TransferError, match="active leases"):
            owner.free_arena(arena)
        owner.leases.release(held.lease_id)
        owner.free_arena(arena)
        assert owner.stats()["arenas"] == 0
        for agent in (owner, reader, stranger):
            await agent.close()

    await main()


@pytest.mark.asyncio
async def test_loopback_refuses_a_handle_of_another_process():
    """An rkey that is not this process's key (the owner's table confirmed
    it) names memory of another process: refused before any byte moves."""

    async def main():
        owner = await create_agent("loopback", token="t", fast_path=False)
        reader = await create_agent("loopback", token="t", fast_path=False)
        arena = owner.allocate_arena(4096)
        arena.rkey = b"another process!"  # as the owner's table will say
        handle = owner.publish(arena, [(0, 64)], NS)
        assert handle.rkey == b"another process!"
        local = reader.allocate_arena(4096)
        local.tensor.fill_(7)
        with pytest.raises(PeerError, match="another process"):
            await reader.read(BlockHandle.from_bytes(handle.to_bytes()), local, [0], namespace=NS)
        assert int(local.tensor.sum()) == 7 * 4096
        for agent in (owner, reader):
            await agent.close()

    await main()


def test_backends_are_chosen_by_name():
    assert make_transport("tcp").name == "tcp"
    with pytest.raises(ValueError, match="unknown transfer backend"):
        make_transport("carrier-pigeon")


@pytest.mark.asyncio
async def test_agents_need_a_cluster_token():
    with pytest.raises(ValueError, match="token"):
        await create_agent("loopback", token="")
