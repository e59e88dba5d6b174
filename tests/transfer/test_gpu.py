"""GPU arenas through UCX (cuda_copy, cuda_ipc): pulls and pushes between GPU
and host memory of two processes. Skipped without CUDA."""

import hashlib

import pytest
import torch

from kvrelay.transfer import create_agent
from tests.transfer.peer import NAMESPACE, TOKEN, pattern

pytestmark = pytest.mark.gpu

SIZE = 4 << 20
# Scattered runs, as a handle of pages of one rank's rectangle looks.
RUNS = [(i * 65536 + 1024, 30000) for i in range(0, 60, 3)]


def second_gpu() -> str:
    return "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"


def local_arena(agent, where: str):
    if where == "host":
        return agent.allocate_arena(SIZE, shared=False)
    return agent.register_tensor(torch.zeros(SIZE, dtype=torch.uint8, device=where))


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("remote", "local"),
    [("host", "cuda:0"), ("cuda:0", "host"), ("cuda:0", "gpu2")],
    ids=["host-to-gpu", "gpu-to-host", "gpu-to-gpu"],
)
async def test_pull_runs_between_gpu_and_host_arenas(start_peer, remote, local):
    local = second_gpu() if local == "gpu2" else local
    device = None if remote == "host" else remote
    peer = start_peer("ucx-gpu", SIZE, [RUNS], device=device, seed=3)
    offsets = [SIZE - (i + 1) * 40000 for i in range(len(RUNS))]

    async def pull():
        async with await create_agent("ucx", token=TOKEN, fast_path=False) as agent:
            arena = local_arena(agent, local)
            await agent.read(peer.handles[0], arena, offsets, namespace=NAMESPACE, timeout=30)
            return arena.tensor.cpu()

    got = await pull()
    source = pattern(SIZE, 3)
    for (start, length), at in zip(RUNS, offsets, strict=True):
        assert torch.equal(got[at : at + length], source[start : start + length])
    assert got[: offsets[-1]].eq(0).all()  # nothing written outside the runs


@pytest.mark.asyncio
@pytest.mark.parametrize("remote", ["host", "cuda:0"])
async def test_push_from_a_gpu_arena(start_peer, remote):
    """What a GPU rank does to the tier (host) or a GPU peer: one-sided PUTs."""
    device = None if remote == "host" else remote
    peer = start_peer("ucx-gpu", SIZE, [[(0, SIZE)]], device=device, seed=4)
    mine = pattern(SIZE, 5)

    async def push():
        async with await create_agent("ucx", token=TOKEN, fast_path=False) as agent:
            arena = agent.register_tensor(mine.to(second_gpu()))
            await agent.write(peer.handles[0], arena, [0], namespace=NAMESPACE, timeout=30)

    await push()
    assert peer.digest() == hashlib.sha256(mine.numpy().tobytes()).digest()


@pytest.mark.asyncio
async def test_host_only_backends_refuse_gpu_tensors():
    async def register():
        async with await create_agent("tcp", token=TOKEN) as agent:
            with pytest.raises(ValueError, match="host memory only"):
                agent.register_tensor(torch.zeros(16, dtype=torch.uint8, device="cuda"))

    await register()
