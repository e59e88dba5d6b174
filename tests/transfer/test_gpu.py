"""GPU arenas (ucx only). Skipped without CUDA; never yet run in this project."""

import asyncio

import pytest
import torch

from kvrelay.transfer import create_agent
from tests.transfer.peer import NAMESPACE, TOKEN, pattern

SIZE = 4 << 20


@pytest.mark.gpu
def test_pull_from_a_host_arena_into_a_gpu_arena(start_peer):
    peer = start_peer("ucx-shm", SIZE, [[(0, SIZE)]])

    async def pull():
        async with await create_agent("ucx", token=TOKEN) as agent:
            local = agent.register_tensor(torch.zeros(SIZE, dtype=torch.uint8, device="cuda"))
            await agent.read(peer.handles[0], local, [0], namespace=NAMESPACE, timeout=30)
            assert torch.equal(local.tensor.cpu(), pattern(SIZE, 0))

    asyncio.run(pull())


@pytest.mark.gpu
def test_host_only_backends_refuse_gpu_tensors():
    async def register():
        async with await create_agent("tcp", token=TOKEN) as agent:
            with pytest.raises(ValueError, match="host memory only"):
                agent.register_tensor(torch.zeros(16, dtype=torch.uint8, device="cuda"))

    asyncio.run(register())
