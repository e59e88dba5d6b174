"""Optional peer of `kvrelay bench transfer`: NIXL's UCX backend READ of the
same cases (same arena size, same run offsets and lengths, the same
destination layout, buffers allocated like kvrelay's private arenas, each
read timed from a cold cache) between two spawned processes on this host.

NIXL is never a dependency: it is looked for lazily (`nixl`, or the wheels
`nixl_cu12` / `nixl_cu13` that the `nixl` meta-package wraps) and, when
absent or failing, the bench prints one line and goes on without it. NIXL
ships its own UCX (`nixl_cu12.libs/libucp-*.so`, separate from the
`libucx-cu12` wheel behind `kvrelay._ucx`), so both of its processes are
spawned and import nothing of kvrelay's transfer engine: two UCX copies in
one process would share environment and signal handlers. Settings measured
to matter here: `UCX_MODULES=^ib` (without it the processes crash at exit on
a host with no InfiniBand) and no progress thread (idle, it spins a core).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import multiprocessing
import os
import sys
import time
from collections.abc import Mapping, Sequence

import numpy as np

from kvrelay.bench.stats import Summary

NIXL_MODULES = ("nixl", "nixl_cu12", "nixl_cu13")
ROW_LABEL = "NIXL UCX READ"
# NIXL's READ with its descriptors made inside the timed call, as a serving
# system makes them per request; shown beside the prepared READ (what the
# goals are measured against), never instead of it.
PER_READ_LABEL = "NIXL UCX READ, descriptors per read"
# NIXL's UCX loads the ib transport modules by default; with no InfiniBand
# device they crash the process at exit.
NIXL_ENV = {"UCX_MODULES": "^ib"}
_STARTUP_S = 120.0
# The owner's UCX worker is progressed between polls of its control pipe
# (wire-up needs it); reads themselves are one-sided (cma / shared memory).
_OWNER_POLL_S = 0.01

Runs = Sequence[tuple[int, int]]


def find_nixl() -> str | None:
    """The name of an importable NIXL module, found without importing it (so
    NIXL's UCX never loads into the bench's own process)."""
    for name in NIXL_MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                return name
        except (ImportError, ValueError):
            continue
    return None


def descriptor_rows(runs: Runs, local_base: int, remote_base: int) -> tuple:
    """NIXL xfer descriptor arrays (address, length, device id) for reading
    `runs` (offset, length) of the remote buffer into the local buffer at
    the bench's own destination layout (`transfer_pulls.local_offsets`)."""
    from kvrelay.bench.transfer_pulls import local_offsets

    if not runs:
        raise ValueError("a transfer needs at least one run")
    table = np.asarray(runs, dtype=np.int64).reshape(-1, 2)
    if (table[:, 0] < 0).any() or (table[:, 1] <= 0).any():
        raise ValueError("runs need offsets >= 0 and lengths > 0")
    packed = np.asarray(local_offsets([tuple(r) for r in table.tolist()]), dtype=np.int64)
    zeros = np.zeros(len(table), dtype=np.int64)
    local = np.stack([local_base + packed, table[:, 1], zeros], axis=1)
    remote = np.stack([remote_base + table[:, 0], table[:, 1], zeros], axis=1)
    return local, remote


def _import_nixl(name: str):
    os.environ.update(NIXL_ENV)  # before NIXL's UCX reads its configuration
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # not a line per agent
    return importlib.import_module(name)


def _agent(nixl, name: str):
    config = nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    agent = nixl.nixl_agent(name, config)
    if "UCX" not in agent.backends:
        raise RuntimeError("NIXL has no UCX backend plugin")
    return agent


def _owner(module: str, conn, arena_bytes: int) -> None:
    try:
        nixl = _import_nixl(module)
        import torch

        from kvrelay.transfer.arena import private_tensor

        agent = _agent(nixl, "kvrelay-bench-owner")
        # Word i holds i: the reader checks each run landed where it should.
        # Allocated as kvrelay's private arenas are (huge pages where allowed).
        arena = private_tensor(arena_bytes).view(torch.int64)
        torch.arange(arena_bytes // 8, dtype=torch.int64, out=arena)
        agent.register_memory(arena)
        conn.send(("ok", agent.get_agent_metadata(), arena.data_ptr()))
    except Exception as exc:  # the reader reports it, once
        # The reader may have failed the same way and gone already.
        with contextlib.suppress(OSError):
            conn.send(("error", f"owner: {type(exc).__name__}: {exc}"))
        return
    # Until the reader says stop or its end closes (poll is then true too).
    while not conn.poll(_OWNER_POLL_S):
        agent.get_new_notifs()  # progresses the worker (wire-up requests)


def _reader(module: str, owner_conn, results, cases, runs: int, timeout: float) -> None:
    try:
        results.send(("ok", _read_cases(module, owner_conn, cases, runs, timeout)))
    except Exception as exc:  # reported once by the bench, not as a traceback
        results.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        with contextlib.suppress(OSError):  # the owner may be gone already
            owner_conn.send("stop")


def _read_cases(module: str, owner_conn, cases, runs: int, timeout: float) -> dict:
    nixl = _import_nixl(module)
    import torch

    from kvrelay.bench.transfer_pulls import sweep_bytes
    from kvrelay.transfer.arena import private_tensor

    if "kvrelay._ucx" in sys.modules:
        raise RuntimeError("kvrelay's UCX binding is loaded in the NIXL process")
    agent = _agent(nixl, "kvrelay-bench-reader")
    largest = max(sum(n for _, n in run_list) for _, run_list in cases)
    local = private_tensor(largest)
    agent.register_memory(local)
    sweep = torch.zeros(sweep_bytes(), dtype=torch.uint8)
    if not owner_conn.poll(_STARTUP_S):
        raise TimeoutError("the NIXL owner process did not start")
    reply = owner_conn.recv()
    if reply[0] != "ok":
        raise RuntimeError(reply[1])
    metadata, remote_base = reply[1:]
    owner = agent.add_remote_agent(metadata)
    out = {}
    for name, run_list in cases:
        rows = descriptor_rows(run_list, local.data_ptr(), remote_base)
        handle = _prepare(agent, owner, *rows)
        local.zero_()
        times, per_read = [], []
        for i in range(runs + 1):  # the first read connects: not timed
            sweep.add_(1)  # from a cold cache, as the bench's pulls
            start = time.perf_counter()
            _transfer(agent, handle, timeout)
            if i:
                times.append(time.perf_counter() - start)
        agent.release_xfer_handle(handle)
        _check_landed(local, run_list)
        for _ in range(runs):
            # What a serving system does per request: descriptors for this
            # request's blocks, then the READ (kvrelay's pull decodes a new
            # handle and plans it each time).
            sweep.add_(1)
            start = time.perf_counter()
            handle = _prepare(agent, owner, *rows)
            _transfer(agent, handle, timeout)
            per_read.append(time.perf_counter() - start)
            agent.release_xfer_handle(handle)
        out[name] = (times, per_read)
    agent.remove_remote_agent(owner)
    return out


def _prepare(agent, owner, local_rows, remote_rows):
    """A READ's xfer handle: descriptors of both sides, then initialize_xfer."""
    return agent.initialize_xfer(
        "READ",
        agent.get_xfer_descs(local_rows, "DRAM"),
        agent.get_xfer_descs(remote_rows, "DRAM"),
        owner,
    )


def _transfer(agent, handle, timeout: float) -> None:
    deadline = time.perf_counter() + timeout
    state = agent.transfer(handle)
    while state == "PROC":
        if time.perf_counter() > deadline:
            raise TimeoutError(f"a NIXL READ did not finish in {timeout:g} s")
        state = agent.check_xfer_state(handle)
    if state != "DONE":
        raise RuntimeError(f"a NIXL READ ended in state {state}")


def _check_landed(local, run_list: Runs) -> None:
    import torch

    from kvrelay.bench.transfer_pulls import local_offsets

    for (offset, length), at in zip(run_list, local_offsets(run_list), strict=True):
        if offset % 8 or length % 8:
            raise ValueError("the check needs 8-byte aligned runs")
        got = local[at : at + length].view(torch.int64)
        first = offset // 8
        if not torch.equal(got, torch.arange(first, first + length // 8, dtype=torch.int64)):
            raise RuntimeError(f"run at {offset} did not land at {at}")


def _placed(namespace: str, target, *args) -> None:
    """`target(*args)` in network namespace `namespace`, UCX held to tcp (`--netns`)."""
    from kvrelay.bench.netns import enter

    enter(namespace)
    os.environ["UCX_TLS"] = "tcp"
    target(*args)


def measure(
    cases, arena_bytes: int, runs: int, timeout: float, netns=None
) -> dict[str, tuple] | None:
    """Per case, (seconds per prepared NIXL READ of its runs, seconds per
    READ with its descriptors made in the timed call), `runs` of each after
    one untimed read; or None with the reason printed when NIXL is absent or
    fails. `netns` (`bench.netns.TwoHosts`): the owner runs on its first host,
    the reader on its second, over tcp."""
    if runs < 1:
        raise ValueError("runs must be >= 1")
    for name, run_list in cases:
        if any(offset + length > arena_bytes for offset, length in run_list):
            raise ValueError(f"case {name!r} reads past the {arena_bytes}-byte arena")
    module = find_nixl()
    if module is None:
        print(f"NIXL peer: skipped (none of {', '.join(NIXL_MODULES)} is importable)")
        return None
    ctx = multiprocessing.get_context("spawn")
    owner_end, reader_end = ctx.Pipe()
    results_in, results_out = ctx.Pipe(duplex=False)
    owner_args = (_owner, module, owner_end, arena_bytes)
    reader_args = (_reader, module, reader_end, results_out, list(cases), runs, timeout)
    if netns is not None:
        owner_args = (_placed, netns.names[0], *owner_args)
        reader_args = (_placed, netns.names[1], *reader_args)
    owner = ctx.Process(target=owner_args[0], args=owner_args[1:], daemon=True)
    reader = ctx.Process(target=reader_args[0], args=reader_args[1:], daemon=True)
    owner.start()
    reader.start()
    for end in (owner_end, reader_end, results_out):
        end.close()  # the children hold them now: their exit reads as EOF here
    # Every transfer has its own deadline in the reader; this bound only
    # catches a reader that hangs outside a transfer.
    deadline = time.monotonic() + _STARTUP_S + timeout * len(cases) * (runs + 1)
    status, payload = "error", "the NIXL reader took too long"
    try:
        while time.monotonic() < deadline:
            if results_in.poll(0.5):
                status, payload = results_in.recv()
                break
            if not reader.is_alive():
                payload = f"the NIXL reader exited with code {reader.exitcode}"
                break
    except EOFError:
        payload = f"the NIXL reader exited with code {reader.exitcode}"
    finally:
        for process in (reader, owner):
            process.join(30)
            if process.is_alive():
                process.kill()
                process.join(10)
    if status != "ok":
        print(f"NIXL peer: skipped ({payload})")
        return None
    return payload


def table_row(
    name: str, nbytes: int, seconds: Sequence[float], memcpy_median: float, label: str = ROW_LABEL
) -> list:
    """The bench table's row for NIXL: case, path, GB/s, [min-max], x memcpy, x baseline."""
    s = Summary.of(seconds)
    return [
        name,
        label,
        f"{nbytes / s.median / 1e9:.2f}",
        f"{nbytes / s.max / 1e9:.2f}-{nbytes / s.min / 1e9:.2f}",
        f"{memcpy_median / s.median:.2f}",
        "-",
    ]


def x_nixl(nixl_seconds: Sequence[float], pull_seconds: Sequence[float]) -> float:
    """How many times NIXL's rate a pull reaches: NIXL's median time over the pull's."""
    return Summary.of(nixl_seconds).median / Summary.of(pull_seconds).median


def case_json(nixl_seconds: Sequence[float], pulls: Mapping[str, Sequence[float]]) -> dict:
    """NIXL's times for one case and each mode's ratio to it."""
    ratios = {mode: x_nixl(nixl_seconds, times) for mode, times in pulls.items()}
    return Summary.of(nixl_seconds).to_json() | {"x_nixl_by_mode": ratios}


def ratio_line(
    name: str,
    nixl_seconds: Sequence[float],
    pulls: Mapping[str, Sequence[float]],
    label: str = ROW_LABEL,
):
    ratios = ", ".join(f"{mode} {x_nixl(nixl_seconds, t):.2f}" for mode, t in pulls.items())
    return f"x {label} ({name}; NIXL median time / pull median time): {ratios}"
