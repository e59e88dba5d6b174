"""Two real processes (spawn) on one host: correctness of every backend and
of the fast path, writes, and a peer killed mid-transfer."""

import hashlib
import random
import threading
import time

import pytest
import torch

from kvrelay.transfer import BlockHandle, PeerError, create_agent
from tests.transfer.conftest import MODES, mode_agent_kwargs, pull_until_owner_killed
from tests.transfer.peer import NAMESPACE, TOKEN, pattern

SIZE = 4 << 20
RUN = 4096


def small_runs(count=256, seed=1):
    """Random, non-adjacent 4 KiB runs in shuffled order."""
    slots = random.Random(seed).sample(range(SIZE // (2 * RUN)), count)
    return [(2 * RUN * s, RUN) for s in slots]


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", list(MODES))
async def test_pull_single_large_run_and_a_batch_of_small_runs(mode, start_peer):
    single = [(RUN, SIZE - 2 * RUN)]
    batch = small_runs()
    peer = start_peer(mode, SIZE, [single, batch])
    backend, kwargs = mode_agent_kwargs(mode)
    expected = pattern(SIZE, 0)

    async def pull():
        async with await create_agent(backend, token=TOKEN, **kwargs) as agent:
            local = agent.allocate_arena(SIZE)
            await agent.read(peer.handles[0], local, [0], namespace=NAMESPACE, timeout=20)
            got = local.tensor[: SIZE - 2 * RUN]
            assert _sha(got) == _sha(expected[RUN : SIZE - RUN])
            local.tensor.zero_()
            handle = BlockHandle.from_bytes(peer.handles[1])
            offsets = [i * RUN for i in range(len(batch))]
            await agent.read(handle, local, offsets, namespace=NAMESPACE, timeout=20)
            for offset, (remote, n) in zip(offsets, batch, strict=True):
                want = expected[remote : remote + n]
                assert _sha(local.tensor[offset : offset + n]) == _sha(want)
            # Only the mapped copy maps the peer's memfd; readv needs no mapping.
            assert agent.stats()["mappings"] == (1 if MODES[mode][2] == "map" else 0)

    await pull()


@pytest.mark.asyncio
async def test_fast_path_splits_a_large_pull_over_threads(start_peer):
    size = 24 << 20  # copied by two threads where the calibration chose two
    peer = start_peer("fastpath-map", size, [[(4096, size - 4096)]])

    async def pull():
        async with await create_agent("ucx", token=TOKEN) as agent:
            local = agent.allocate_arena(size)
            await agent.read(peer.handles[0], local, [0], namespace=NAMESPACE, timeout=20)
            want = pattern(size, 0)[4096:]
            assert _sha(local.tensor[: size - 4096]) == _sha(want)

    await pull()


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", list(MODES))
async def test_push_a_batch_into_the_peer_arena(mode, start_peer):
    batch = small_runs(64, seed=2)
    peer = start_peer(mode, SIZE, [batch])
    backend, kwargs = mode_agent_kwargs(mode)
    expected = pattern(SIZE, 0).clone()
    source = pattern(len(batch) * RUN, 7)

    async def push():
        async with await create_agent(backend, token=TOKEN, **kwargs) as agent:
            local = agent.allocate_arena(len(batch) * RUN)
            local.tensor.copy_(source)
            offsets = [i * RUN for i in range(len(batch))]
            await agent.write(peer.handles[0], local, offsets, namespace=NAMESPACE, timeout=20)

    await push()
    for i, (remote, n) in enumerate(batch):
        expected[remote : remote + n] = source[i * RUN : (i + 1) * RUN]
    assert peer.digest() == hashlib.sha256(expected.numpy().tobytes()).digest()


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", list(MODES))
async def test_peer_killed_mid_transfer_fails_within_the_timeout(mode, start_peer):
    size = 32 << 20
    batch = [(i * 65536, 65536) for i in range(512)]
    peer = start_peer(mode, size, [batch])
    backend, kwargs = mode_agent_kwargs(mode)
    timeout = 5.0

    async def pull_until_killed():
        agent = await create_agent(backend, token=TOKEN, **kwargs)
        local = agent.allocate_arena(size)
        offsets = [i * 65536 for i in range(512)]
        stats = await pull_until_owner_killed(agent, peer, local, offsets, timeout)
        # The failed peer holds nothing any more.
        assert stats["peers"] == 0 and stats["mappings"] == 0
        assert stats.get("ucx_endpoints", 0) == 0 and stats.get("ucx_rkeys", 0) == 0
        await agent.close()

    await pull_until_killed()


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["fastpath-map", "fastpath-readv"])
async def test_fast_path_reads_a_restarted_peer_arena(mode, start_peer):
    """One reader pulls from a peer, the peer exits and a new one (new pid,
    new memfd, other bytes) takes its place: the reader, whose mapping or pid
    was of the first, gets the new arena's bytes bit for bit."""
    batch = small_runs(64, seed=3)
    offsets = [i * RUN for i in range(len(batch))]
    backend, kwargs = mode_agent_kwargs(mode)

    async def pull_from(agent, local, peer, seed):
        local.tensor.zero_()
        await agent.read(peer.handles[0], local, offsets, namespace=NAMESPACE, timeout=20)
        expected = pattern(SIZE, seed)
        for offset, (remote, n) in zip(offsets, batch, strict=True):
            assert _sha(local.tensor[offset : offset + n]) == _sha(expected[remote : remote + n])

    async def pull():
        async with await create_agent(backend, token=TOKEN, **kwargs) as agent:
            local = agent.allocate_arena(len(batch) * RUN)
            first = start_peer(mode, SIZE, [batch], seed=4)
            await pull_from(agent, local, first, 4)
            first.stop()
            second = start_peer(mode, SIZE, [batch], seed=5)
            await pull_from(agent, local, second, 5)
            await pull_from(agent, local, second, 5)  # the second mapping, reused
            assert agent.stats()["mappings"] == (1 if mode == "fastpath-map" else 0)

    await pull()


def _sha(tensor) -> bytes:
    return hashlib.sha256(tensor.contiguous().numpy().tobytes()).digest()


@pytest.mark.asyncio
async def test_a_pull_from_a_killed_owner_fails_at_once_and_writes_nothing(start_peer):
    """Over cma a dead owner is seen only on its control connection (its pid
    could be another process's by now): the binding checks it for a hang-up
    before posting, so the pull fails at once and moves no byte."""
    batch = small_runs(64)
    peer = start_peer("ucx-shm", SIZE, [batch])
    backend, kwargs = mode_agent_kwargs("ucx-shm")
    agent = await create_agent(backend, token=TOKEN, **kwargs)
    try:
        local = agent.allocate_arena(SIZE)
        offsets = [i * RUN for i in range(len(batch))]
        await agent.read(peer.handles[0], local, offsets, namespace=NAMESPACE, timeout=10)
        peer.process.kill()
        peer.process.join(10)
        local.tensor.fill_(0)
        started = time.monotonic()
        with pytest.raises(PeerError, match="closed its control connection"):
            await agent.read(peer.handles[0], local, offsets, namespace=NAMESPACE, timeout=10)
        assert time.monotonic() - started < 2.0
        assert not local.tensor.any()
        assert agent.stats()["peers"] == 0
    finally:
        await agent.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", ["tcp", "ucx"])
async def test_a_registered_host_tensor_is_copied_by_the_kernel_from_its_owner(start_peer, backend):
    """An engine's own KV memory (a registered tensor, not a memfd) is read on
    one host with process_vm_readv from the owner's pid, whatever the backend."""
    runs = [[(0, SIZE // 2), (SIZE // 2 + 64, 4096)]]
    peer = start_peer("tcp" if backend == "tcp" else "fastpath-readv", SIZE, runs,
                      registered=True, fast_path=True)  # fmt: skip
    handle = BlockHandle.from_bytes(peer.handles[0])
    async with await create_agent(backend, token=TOKEN) as agent:
        local = agent.allocate_arena(SIZE)
        await agent.read(handle, local, [0, SIZE // 2], namespace=NAMESPACE, timeout=10)
        info = agent._peers[handle.agent].arenas[handle.arena_id]
        assert info.pid == peer.pid and not info.shm
        expected = pattern(SIZE, 0)
        assert torch.equal(local.tensor[: SIZE // 2], expected[: SIZE // 2])
        assert torch.equal(local.tensor[SIZE // 2 : SIZE // 2 + 4096],
                           expected[SIZE // 2 + 64 : SIZE // 2 + 64 + 4096])  # fmt: skip


@pytest.mark.asyncio
async def test_copy_mapped_hands_a_same_host_peers_arena_to_the_caller(start_peer):
    """`Agent.copy_mapped`: the owner's arena mapped here, after the checks a
    transfer makes; refused (False) where the fast path is off."""
    from kvrelay.transfer import NamespaceMismatch

    runs = [(4096, 8192), (65536, 4096)]
    peer = start_peer("fastpath-map", SIZE, [runs])
    handle = BlockHandle.from_bytes(peer.handles[0])
    want = pattern(SIZE, 0)
    seen = []

    def take(arena) -> None:
        seen.append([_sha(arena[o : o + n]) for o, n in runs])

    async with await create_agent("tcp", token=TOKEN) as agent:
        assert agent.peer_is_mapped(handle.agent) is None  # not met yet
        assert agent.known_mapping(handle, NAMESPACE) is None
        assert await agent.copy_mapped(handle, take, namespace=NAMESPACE, timeout=30)
        assert seen == [[_sha(want[o : o + n]) for o, n in runs]]
        with pytest.raises(NamespaceMismatch):
            await agent.copy_mapped(handle, take, namespace=b"x" * 32, timeout=30)
        # Met: another thread may copy through the agent's mapping, under its
        # lock; dropping the peer waits for that copy before it unmaps.
        assert agent.peer_is_mapped(handle.agent) is True
        mapped = agent.known_mapping(handle, NAMESPACE)
        assert _sha(mapped.tensor()[4096 : 4096 + 8192]) == _sha(want[4096 : 4096 + 8192])
        with pytest.raises(NamespaceMismatch):
            agent.known_mapping(handle, b"x" * 32)
        held = threading.Event()

        def copy_slowly() -> None:
            with mapped.lock:
                held.set()
                time.sleep(0.3)

        copier = threading.Thread(target=copy_slowly)
        copier.start()
        assert held.wait(5)
        start = time.monotonic()
        agent._drop_peer(agent._peers[handle.agent])
        assert time.monotonic() - start >= 0.2 and mapped.size == 0
        copier.join(5)
        assert agent.peer_is_mapped(handle.agent) is None
    async with await create_agent("tcp", token=TOKEN, fast_path=False) as agent:
        assert not await agent.copy_mapped(handle, take, namespace=NAMESPACE, timeout=30)
        assert agent.peer_is_mapped(handle.agent) is False
    assert len(seen) == 1
