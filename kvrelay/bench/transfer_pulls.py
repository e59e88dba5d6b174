"""What `kvrelay bench transfer` does the same on host and GPU memory: the
cases, the spawned owner process that publishes them, and the timed pull
loop (a baseline timed right before each pull, the first pull apart).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import multiprocessing
import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack

TOKEN = "kvrelay-bench"
NAMESPACE = hashlib.sha256(b"kvrelay bench transfer").digest()


def bench_cases(args) -> tuple[int, list[tuple]]:
    """The arena's bytes and the (name, runs) cases `args` asks for."""
    arena = args.arena_mib << 20
    sizes = [int(s) for s in args.sizes_mib.split(",") if s]
    return arena, _cases(arena, sizes, args.batch, args.run_kib)


def _cases(arena: int, sizes_mib: list[int], batch: int, run_kib: int) -> list[tuple]:
    cases = [(f"single {s} MiB", [(0, s << 20)]) for s in sizes_mib if s << 20 <= arena]
    slots = random.Random(0).sample(range(arena // (run_kib << 10)), batch)
    cases.append(
        (f"batch {batch} x {run_kib} KiB", [(s * (run_kib << 10), run_kib << 10) for s in slots])
    )
    # ucx_perftest's access pattern: the same run read `batch` times into the
    # same place (both stay in the cache), to tell the cost of random runs of
    # a large arena from the cost of the path.
    cases.append((f"batch {batch} x {run_kib} KiB, one run", [(0, run_kib << 10)] * batch))
    return cases


def local_offsets(run_list) -> list[int]:
    """Where a case's runs land in the reader's arena: one after another, or
    all at 0 when the case reads one run again and again (as ucx_perftest
    does)."""
    if len(run_list) > 1 and len(set(run_list)) == 1:
        return [0] * len(run_list)
    offsets, at = [], 0
    for _, n in run_list:
        offsets.append(at)
        at += n
    return offsets


def sweep_bytes() -> int:
    """Twice the last-level cache (at least 64 MiB): writing it evicts the cache."""
    size = 32 << 20
    with contextlib.suppress(OSError, ValueError):
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        size = int(text.rstrip("KMG")) * units.get(text[-1], 1)
    return max(64 << 20, 2 * size)


@contextlib.contextmanager
def restored_ucx_tls() -> Iterator[None]:
    """UCX_TLS as it was before the block, whatever the block set it to."""
    saved = os.environ.get("UCX_TLS")
    try:
        yield
    finally:
        os.environ.pop("UCX_TLS", None)
        if saved is not None:
            os.environ["UCX_TLS"] = saved


@contextlib.contextmanager
def owner_process(target: Callable, args: tuple) -> Iterator[list[bytes]]:
    """Spawns `target(pipe, *args)`, yields the handles it publishes (see
    `publish_until_stopped`), and stops it when the block ends."""
    ctx = multiprocessing.get_context("spawn")
    pipe, child = ctx.Pipe()
    owner = ctx.Process(target=target, args=(child, *args), daemon=True)
    owner.start()
    try:
        if not pipe.poll(120):
            raise RuntimeError("the owner process did not start")
        yield msgpack.unpackb(pipe.recv_bytes())
    finally:
        pipe.send_bytes(b"stop")
        owner.join(30)
        if owner.is_alive():
            owner.kill()


async def publish_until_stopped(pipe, agent, arena, runs_list) -> None:
    """The owner's side: publishes each case's runs, sends the handles, and
    keeps them readable until the reader says stop."""
    handles = [agent.publish(arena, runs, NAMESPACE).to_bytes() for runs in runs_list]
    pipe.send_bytes(msgpack.packb(handles))
    await asyncio.get_running_loop().run_in_executor(None, pipe.recv_bytes)
    await agent.close()


async def timed_pulls(agent, local, cases, handles, runs: int, timeout: float, baseline) -> dict:
    """name -> (pull seconds, baseline seconds, first pull seconds) for each
    case: `runs` timed pulls, each right after `baseline(nbytes)` (which
    returns the seconds of its own timed copy of the same byte count), so a
    noisy phase of the machine hits both. The first pull connects and maps:
    it is kept apart, with no baseline."""
    out = {}
    for (name, run_list), handle in zip(cases, handles, strict=True):
        offsets = local_offsets(run_list)
        nbytes = sum(n for _, n in run_list)
        pulls, baselines, first = [], [], None
        for i in range(runs + 1):
            before = baseline(nbytes)
            start = time.perf_counter()
            await agent.read(handle, local, offsets, namespace=NAMESPACE, timeout=timeout)
            took = time.perf_counter() - start
            if i:
                pulls.append(took)
                baselines.append(before)
            else:
                first = took
        out[name] = (pulls, baselines, first)
    return out
