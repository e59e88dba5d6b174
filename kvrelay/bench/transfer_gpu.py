"""`kvrelay bench transfer --device cuda[:N]`: UCX pulls of GPU memory.

An owner process publishes the same cases as the host benchmark (single runs
and a batch of random runs) from an arena in GPU memory (or host memory),
and this process pulls them over UCX (cuda_copy, cuda_ipc: UCX_TLS below)
into an arena on `--device` (or host memory). Directions: GPU <- GPU (the
owner on the next GPU when there is one, else the same GPU, another
process), GPU <- host (what a GPU rank reads from the tier) and host <- GPU
(what the tier or a pinned-staging rank reads from a GPU rank). The
baseline, timed right before each pull: a device-to-device `copy_` of the
same byte count on the reader's GPU.
"""

from __future__ import annotations

import asyncio
import os

import torch

from kvrelay.bench.stats import Summary, format_table, machine_info, time_once, write_json
from kvrelay.bench.transfer_pulls import (
    TOKEN,
    bench_cases,
    owner_process,
    publish_until_stopped,
    restored_ucx_tls,
    timed_pulls,
)

UCX_TLS = "sm,self,cuda_copy,cuda_ipc"
# name: (owner's arena, reader's arena); "gpu" = the reader's device, "peer" =
# the owner's GPU.
DIRECTIONS = {
    "gpu<-gpu": ("peer", "gpu"),
    "gpu<-host": ("host", "gpu"),
    "host<-gpu": ("peer", "host"),
}


def _owner(pipe, device: str, arena_bytes: int, runs_list) -> None:
    os.environ["UCX_TLS"] = UCX_TLS
    asyncio.run(_own(pipe, device, arena_bytes, runs_list))


async def _own(pipe, device, arena_bytes, runs_list) -> None:
    from kvrelay.transfer import create_agent

    agent = await create_agent("ucx", token=TOKEN, fast_path=False, lease_seconds=3600)
    if device == "host":
        arena = agent.allocate_arena(arena_bytes, shared=False)
    else:
        arena = agent.register_tensor(torch.ones(arena_bytes, dtype=torch.uint8, device=device))
    arena.tensor.fill_(1)
    await publish_until_stopped(pipe, agent, arena, runs_list)


async def _pull(direction, device, peer_device, cases, arena_bytes, runs, timeout) -> dict:
    from kvrelay.transfer import create_agent

    remote, local_kind = DIRECTIONS[direction]
    owner_device = peer_device if remote == "peer" else "host"
    args = (owner_device, arena_bytes, [r for _, r in cases])
    with owner_process(_owner, args) as handles:
        agent = await create_agent("ucx", token=TOKEN, fast_path=False)
        largest = max(sum(n for _, n in r) for _, r in cases)
        if local_kind == "host":
            local = agent.allocate_arena(largest, shared=False)
        else:
            local = agent.register_tensor(torch.zeros(largest, dtype=torch.uint8, device=device))
        src = torch.ones(largest, dtype=torch.uint8, device=device)
        dst = torch.zeros(largest, dtype=torch.uint8, device=device)

        def copy(n: int) -> None:
            dst[:n].copy_(src[:n])
            torch.cuda.synchronize(device)

        def device_copy(n: int) -> float:
            return time_once(lambda: copy(n))

        out = await timed_pulls(agent, local, cases, handles, runs, timeout, device_copy)
        await agent.close()
    return out


def run(args, device: torch.device) -> dict:
    """The GPU benchmark; `device` is the reader's GPU, already validated."""
    peer = torch.device("cuda", (device.index + 1) % torch.cuda.device_count())
    arena, cases = bench_cases(args)
    with restored_ucx_tls():
        os.environ["UCX_TLS"] = UCX_TLS
        pulls = {
            d: asyncio.run(_pull(d, device, str(peer), cases, arena, args.runs, args.timeout))
            for d in DIRECTIONS
        }
    rows, results = [], []
    for direction in DIRECTIONS:
        for name, run_list in cases:
            nbytes = sum(n for _, n in run_list)
            pull_times, copy_times, _ = pulls[direction][name]
            pull, copy = Summary.of(pull_times), Summary.of(copy_times)
            ratio = Summary.of([c / p for p, c in zip(pull_times, copy_times, strict=True)])
            rows.append([
                direction, name, f"{nbytes / 2**20:.0f}", f"{nbytes / pull.median / 1e9:.2f}",
                f"{nbytes / copy.median / 1e9:.2f}",
                f"{ratio.median:.2f} [{ratio.min:.2f}-{ratio.max:.2f}]",
            ])  # fmt: skip
            results.append({
                "direction": direction, "case": name, "bytes": nbytes,
                "pull": pull.to_json(), "copy": copy.to_json(), "pull_vs_copy": ratio.to_json(),
            })  # fmt: skip
    print(format_table(["direction", "case", "MiB", "pull GB/s", "copy_ GB/s", "x copy_"], rows))
    print(
        f"reader on {device}, GPU owner on {peer} (another process); UCX_TLS={UCX_TLS}; "
        "copy_ = device-to-device copy_ of the same bytes on the reader's GPU, same run; "
        "GB/s median, ratio = copy_ time / pull time per run [min-max]"
    )
    payload = {
        "benchmark": "transfer-gpu",
        "config": {k: v for k, v in vars(args).items() if not callable(v)}
        | {"device": str(device), "peer_device": str(peer), "ucx_tls": UCX_TLS},
        "machine": machine_info(),
        "results": results,
    }
    if args.json:
        write_json(args.json, payload)
    return payload
