import asyncio
import contextlib
import multiprocessing
import os
import signal
import time

import msgpack
import pytest

from kvrelay.rpc import RpcError
from kvrelay.transfer import PeerError
from tests.transfer.peer import NAMESPACE, serve

# (backend, UCX_TLS or None, the fast path's copy or None): every way two
# processes on one host move pages. The fast path's two copies are forced
# (the calibrated plan picks one of them per host and batch shape).
MODES = {
    "tcp": ("tcp", None, None),
    "ucx-shm": ("ucx", "sm,self", None),
    "ucx-tcp": ("ucx", "tcp,self", None),
    "fastpath-map": ("ucx", None, "map"),
    "fastpath-readv": ("ucx", None, "readv"),
    # GPU memory: cuda_copy (host <-> GPU), cuda_ipc (GPU <-> GPU across processes).
    "ucx-gpu": ("ucx", "sm,self,cuda_copy,cuda_ipc", None),
}


class PeerProcess:
    """A spawned publishing agent; see tests/transfer/peer.py."""

    def __init__(self, backend, size, runs_list, env, **options):
        ctx = multiprocessing.get_context("spawn")  # never fork after UCX started
        self.pipe, child = ctx.Pipe()
        self.process = ctx.Process(
            target=serve, args=(child, backend, size, runs_list, env, options), daemon=True
        )
        self.process.start()
        if not self.pipe.poll(120):  # spawn + torch import on a loaded 2-core host
            self.process.kill()
            raise RuntimeError("peer process did not start")
        info = msgpack.unpackb(self.pipe.recv_bytes())
        self.address, self.pid, self.handles = info["address"], info["pid"], info["handles"]

    def digest(self) -> bytes:
        self.pipe.send_bytes(b"digest")
        assert self.pipe.poll(30)
        return self.pipe.recv_bytes()

    def stop(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(OSError):  # already dead
                self.pipe.send_bytes(b"stop")
            self.process.join(15)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


@pytest.fixture
def start_peer(monkeypatch):
    """start_peer(mode, size, runs_list, **options) -> PeerProcess; sets UCX_TLS here too."""
    peers = []

    def start(mode, size, runs_list, **options):
        backend, tls, fast = MODES[mode]
        env = {"UCX_TLS": tls} if tls else {}
        if tls:
            monkeypatch.setenv("UCX_TLS", tls)
        else:
            monkeypatch.delenv("UCX_TLS", raising=False)
        peer = PeerProcess(
            backend,
            size,
            runs_list,
            env,
            fast_path=options.pop("fast_path", fast is not None),
            **options,
        )
        peers.append(peer)
        return peer

    yield start
    for peer in peers:
        peer.stop()


def mode_agent_kwargs(mode):
    backend, _, fast = MODES[mode]
    if fast is None:
        return backend, {"fast_path": False}
    return backend, {"fast_path": True, "fast_copy": fast}


async def pull_until_owner_killed(agent, peer, local, offsets, timeout: float) -> dict:
    """Pulls the peer's first handle again and again, killing the owner 0.2 s
    in: the pull it dies under fails (a TransferError or the control
    connection's own error, both RpcError; or TimeoutError) within its
    timeout. The agent's stats afterwards."""
    handle = peer.handles[0]
    await agent.read(handle, local, offsets, namespace=NAMESPACE, timeout=timeout)
    asyncio.get_running_loop().call_later(0.2, os.kill, peer.pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(RpcError) as failure:
        while time.monotonic() - started < 30:
            began = time.monotonic()
            await agent.read(handle, local, offsets, namespace=NAMESPACE, timeout=timeout)
    assert time.monotonic() - began < timeout + 2.0
    assert isinstance(failure.value, PeerError | TimeoutError)
    return agent.stats()
