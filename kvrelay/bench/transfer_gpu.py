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
import multiprocessing
import os
import time

import msgpack
import torch

from kvrelay.bench.stats import Summary, format_table, machine_info, time_once, write_json
from kvrelay.bench.transfer import NAMESPACE, TOKEN, _cases, local_offsets

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
    handles = [agent.publish(arena, runs, NAMESPACE).to_bytes() for runs in runs_list]
    pipe.send_bytes(msgpack.packb(handles))
    await asyncio.get_running_loop().run_in_executor(None, pipe.recv_bytes)
    await agent.close()


async def _pull(direction, device, peer_device, cases, arena_bytes, runs, timeout) -> dict:
    from kvrelay.transfer import create_agent

    remote, local_kind = DIRECTIONS[direction]
    ctx = multiprocessing.get_context("spawn")
    pipe, child = ctx.Pipe()
    owner_device = peer_device if remote == "peer" else "host"
    args = (child, owner_device, arena_bytes, [r for _, r in cases])
    owner = ctx.Process(target=_owner, args=args, daemon=True)
    owner.start()
    out = {}
    try:
        if not pipe.poll(120):
            raise RuntimeError("the owner process did not start")
        handles = msgpack.unpackb(pipe.recv_bytes())
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

        for (name, run_list), handle in zip(cases, handles, strict=True):
            offsets = local_offsets(run_list)
            at = sum(n for _, n in run_list)
            pulls, copies = [], []
            for i in range(runs + 1):  # the first pull connects and registers: not timed
                baseline = time_once(lambda n=at: copy(n))
                start = time.perf_counter()
                await agent.read(handle, local, offsets, namespace=NAMESPACE, timeout=timeout)
                if i:
                    pulls.append(time.perf_counter() - start)
                    copies.append(baseline)
            out[name] = (pulls, copies)
        await agent.close()
    finally:
        pipe.send_bytes(b"stop")
        owner.join(30)
        if owner.is_alive():
            owner.kill()
    return out


def run(args, device: torch.device) -> dict:
    """The GPU benchmark; `device` is the reader's GPU, already validated."""
    peer = torch.device("cuda", (device.index + 1) % torch.cuda.device_count())
    arena = args.arena_mib << 20
    sizes = [int(s) for s in args.sizes_mib.split(",") if s]
    cases = _cases(arena, sizes, args.batch, args.run_kib)
    saved = os.environ.get("UCX_TLS")
    os.environ["UCX_TLS"] = UCX_TLS
    try:
        pulls = {
            d: asyncio.run(_pull(d, device, str(peer), cases, arena, args.runs, args.timeout))
            for d in DIRECTIONS
        }
    finally:
        os.environ.pop("UCX_TLS", None)
        if saved is not None:
            os.environ["UCX_TLS"] = saved
    rows, results = [], []
    for direction in DIRECTIONS:
        for name, run_list in cases:
            nbytes = sum(n for _, n in run_list)
            pull_times, copy_times = pulls[direction][name]
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
