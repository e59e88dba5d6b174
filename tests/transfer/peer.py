"""A publishing agent in its own process (started with spawn) for the tests.

The parent talks to it over a multiprocessing pipe with msgpack bytes only:
the peer sends {address, pid, handles}; then answers "digest" with the sha256
of its arena and exits on "stop".
"""

from __future__ import annotations

import asyncio
import hashlib
import os

import msgpack
import torch

TOKEN = "test-cluster-token"
NAMESPACE = hashlib.sha256(b"kvrelay transfer tests").digest()


def pattern(size: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)


def serve(pipe, backend: str, size: int, runs_list, env: dict, options: dict) -> None:
    os.environ.update(env)
    asyncio.run(_serve(pipe, backend, size, runs_list, options))


async def _serve(pipe, backend, size, runs_list, options) -> None:
    from kvrelay.transfer import create_agent

    lease = options.get("lease_seconds", 60.0)
    agent = await create_agent(backend, token=TOKEN, fast_path=options.get("fast_path", True))
    if options.get("device"):  # a GPU arena (ucx), registered from a CUDA tensor
        gpu = torch.zeros(size, dtype=torch.uint8, device=options["device"])
        arena = agent.register_tensor(gpu)
    elif options.get("registered"):  # a caller's host tensor, not a memfd
        arena = agent.register_tensor(torch.zeros(size, dtype=torch.uint8))
    else:
        arena = agent.allocate_arena(size)
    arena.tensor.copy_(pattern(size, options.get("seed", 0)))
    handles = [agent.publish(arena, runs, NAMESPACE, lease).to_bytes() for runs in runs_list]
    pipe.send_bytes(
        msgpack.packb({"address": agent.address, "pid": os.getpid(), "handles": handles})
    )
    loop = asyncio.get_running_loop()
    while True:
        command = await loop.run_in_executor(None, pipe.recv_bytes)
        if command == b"stop":
            break
        if command == b"digest":
            pipe.send_bytes(hashlib.sha256(arena.tensor.cpu().numpy().tobytes()).digest())
    await agent.close()
