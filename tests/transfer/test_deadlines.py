"""Every wait ends: a stalled peer (SIGSTOP) times out, a cancelled pull stops,
and the agent keeps nothing registered for the peer afterwards."""

import asyncio
import hashlib
import os
import signal
import sys
import time

import pytest

from kvrelay.transfer import BackendUnavailable, TransferTimeout, create_agent
from tests.transfer.conftest import mode_agent_kwargs
from tests.transfer.peer import NAMESPACE, TOKEN, pattern

SIZE = 8 << 20


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["tcp", "ucx-tcp"])
async def test_a_stalled_peer_times_out(mode, start_peer):
    peer = start_peer(mode, SIZE, [[(0, SIZE)]])
    backend, kwargs = mode_agent_kwargs(mode)

    async def pull():
        agent = await create_agent(backend, token=TOKEN, **kwargs)
        local = agent.allocate_arena(SIZE)
        await agent.read(peer.handles[0], local, [0], namespace=NAMESPACE, timeout=20)
        os.kill(peer.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(TransferTimeout):
                await agent.read(peer.handles[0], local, [0], namespace=NAMESPACE, timeout=1.0)
            assert time.monotonic() - started < 4.0
            stats = agent.stats()
            assert stats["peers"] == 0 and stats.get("ucx_rkeys", 0) == 0
        finally:
            os.kill(peer.pid, signal.SIGCONT)
        await agent.read(peer.handles[0], local, [0], namespace=NAMESPACE, timeout=20)
        await agent.close()

    await pull()


@pytest.mark.asyncio
async def test_a_cancelled_pull_stops_and_releases_the_peer(start_peer):
    peer = start_peer("tcp", SIZE, [[(0, SIZE)]])

    async def pull():
        agent = await create_agent("tcp", token=TOKEN, fast_path=False)
        local = agent.allocate_arena(SIZE)
        await agent.read(peer.handles[0], local, [0], namespace=NAMESPACE, timeout=20)
        os.kill(peer.pid, signal.SIGSTOP)
        try:
            task = asyncio.create_task(
                agent.read(peer.handles[0], local, [0], namespace=NAMESPACE, timeout=60)
            )
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            os.kill(peer.pid, signal.SIGCONT)
        assert agent.stats()["peers"] == 0  # the half-read connection was dropped
        local.tensor.zero_()
        await agent.read(peer.handles[0], local, [0], namespace=NAMESPACE, timeout=20)
        assert _sha(local.tensor) == _sha(pattern(SIZE, 0))
        await agent.close()

    await pull()


def _sha(tensor) -> bytes:
    return hashlib.sha256(tensor.numpy().tobytes()).digest()


@pytest.mark.asyncio
async def test_ucx_backend_without_the_binding_says_what_to_install(monkeypatch):
    import kvrelay

    monkeypatch.setitem(sys.modules, "kvrelay._ucx", None)  # as if it was not built
    monkeypatch.delattr(kvrelay, "_ucx", raising=False)
    monkeypatch.delitem(sys.modules, "kvrelay.transfer.backends.ucx", raising=False)
    with pytest.raises(BackendUnavailable, match=r"libucx-cu12.*UCX_HOME"):
        await create_agent("ucx", token=TOKEN)
