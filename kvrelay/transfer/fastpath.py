"""Same-host fast path: copy straight out of (or into) a peer's shared arena.

When both agents run on one host and in one PID namespace (`host_id`), the
reader copies the runs in one call per batch, the way this host's
calibration (`calibrate.py`) found fastest for the batch's shape: out of the
owner's memfd mapped here through /proc/<pid>/fd/<fd> (once per arena; the
host analogue of CUDA IPC), or by the kernel with process_vm_readv (writev)
from the owner's pid, which needs no mapping. A registered host tensor that
is not a memfd (an engine's own KV cache) is always copied the second way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import time

import numpy as np

from kvrelay.transfer.arena import RemoteMapping, owner_pid
from kvrelay.transfer.calibrate import CopyChoice, CopyPlan, run_copy
from kvrelay.transfer.errors import PeerError
from kvrelay.transfer.handle import ArenaInfo

# Copies up to this size run on the event loop's thread (the copier still
# starts its own threads): handing a 32 MiB batch to an executor thread and
# back cost 1-1.5 ms, a third of the copy. Larger ones block the loop for
# too long (over ~6 ms) and go to an executor thread.
_INLINE_COPY_BYTES = 64 << 20
# A second copying thread only for batches of at least this size: below it
# starting the thread costs more than it saves.
_BYTES_PER_COPY_THREAD = 4 << 20
# Non-temporal stores (where chosen) only where the destination spans at least
# this much: smaller pulls are often read right away, from the cache, and a
# batch that lands its runs on a few lines again and again (ucx_perftest's
# pattern: 512 reads of one 64 KiB run into one place) would send to memory
# what plain stores keep in the cache.
_STREAM_MIN_BYTES = 8 << 20


@functools.cache
def _copy_pool() -> concurrent.futures.ThreadPoolExecutor:
    # One job per batch: the compiled copier starts its own threads.
    return concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvrelay-copy")


def host_id() -> str:
    """Same value exactly when /proc/<pid>/fd of the other agent is reachable and
    both share a network namespace: a process in a network namespace of its own
    (a container, the two-host tests) counts as another host, reached over the
    network only."""
    with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
        boot = f.read().strip()
    pid_ns, net_ns = (os.stat(f"/proc/self/ns/{ns}").st_ino for ns in ("pid", "net"))
    return f"{boot}:{pid_ns}:{net_ns}"


def mapping(peer, info: ArenaInfo) -> RemoteMapping:
    """The peer's arena `info` mapped here (once per arena and peer)."""
    mapped = peer.mappings.get(info.arena_id)
    if mapped is None:
        try:
            mapped = RemoteMapping(info.shm, info.size)
        except OSError as exc:
            raise PeerError(f"cannot map the peer's arena {info.shm}: {exc}") from None
        peer.mappings[info.arena_id] = mapped
    return mapped


def copy_job(peer, info: ArenaInfo, local, triples, read, nbytes: int, plan: CopyPlan):
    """The batch's copy as a no-argument callable, chosen by `plan`."""
    chosen = plan.choose(nbytes, len(triples))
    threads = max(1, min(chosen.threads, nbytes // _BYTES_PER_COPY_THREAD))
    pid = owner_pid(info.shm) if info.shm else (info.pid or None)
    # Memory that is not a memfd (a registered tensor) cannot be mapped here:
    # the kernel copies it from the owner's pid.
    if (chosen.method == "readv" or not info.shm) and pid is not None:
        # rows (local, remote, length); the owner's arena starts at info.base there.
        rows = np.ascontiguousarray(triples[:, [1, 0, 2]])
        choice = CopyChoice("readv", threads)
        return functools.partial(_readv, choice, pid, local.address, info.base, rows, read)
    mapped = mapping(peer, info)
    rows = np.ascontiguousarray(triples[:, [1, 0, 2]] if read else triples)  # (dst, src, length)
    dst, src = (local.address, mapped.address) if read else (mapped.address, local.address)
    footprint = destination_span(rows)
    stream = chosen.method == "map" and chosen.stream and footprint >= _STREAM_MIN_BYTES
    if footprint < _STREAM_MIN_BYTES:
        threads = 1  # two threads storing to the same few lines bounce them between cores
    choice = CopyChoice("map", threads, stream, chosen.prefetch)
    return functools.partial(run_copy, choice, 0, dst, src, rows, nbytes)


def destination_span(rows) -> int:
    """Bytes from the lowest to the highest destination byte of (dst, src,
    length) rows: what the copy leaves in the cache with plain stores."""
    if not len(rows):
        return 0
    starts = rows[:, 0]
    return int((starts + rows[:, 2]).max() - starts.min())


def _readv(choice: CopyChoice, pid: int, local: int, remote: int, rows, read: bool) -> None:
    from kvrelay.transfer.arena import readv_runs

    try:
        readv_runs(pid, local, remote, rows, choice.threads, not read)
    except OSError as exc:  # the owner is gone (ESRCH) or unmapped its arena (EFAULT)
        raise PeerError(f"cannot copy from process {pid}: {exc}") from None


async def copy_shared(
    peer, info: ArenaInfo, local, triples, read, nbytes: int, plan, deadline: float, budget
) -> None:
    """Copies `triples` (`nbytes` in all) between `local` and the peer's arena;
    TimeoutError when a copy on the executor is still running at `deadline`
    (event loop clock; it is then waited for, so nothing writes later).
    `budget` (an `InlineBudget`) says when inline copies yield to the loop."""
    job = copy_job(peer, info, local, triples, read, nbytes, plan)
    if nbytes <= _INLINE_COPY_BYTES:
        started = time.perf_counter()
        job()
        await budget.spent(time.perf_counter() - started)
    else:
        future = _copy_pool().submit(job)
        try:
            async with asyncio.timeout_at(deadline):
                await asyncio.wrap_future(future)
        except (asyncio.CancelledError, TimeoutError):
            # A running copy cannot be stopped; wait for it (it is bounded)
            # so nothing writes into `local` after we return.
            concurrent.futures.wait([future])
            raise
    # A mapping outlives its owner; a dead owner cannot honour its lease.
    if peer.conn is not None and peer.conn.closed_by_peer():
        raise PeerError(f"agent {peer.address} died during the transfer")
