"""What Linux's /proc says of a process, read in one place: its stat fields
(state, process group), its memory counters, its descendants. Every read is
best effort: a process may exit at any moment, and then reads as gone. Also
the two ends of a child's life that benches and tests share: tying it to its
parent (`die_with_parent`) and ending it (`end_process`)."""

from __future__ import annotations

import os


def stat_fields(pid: int | str) -> list[str]:
    """The fields of `/proc/<pid>/stat` after the command name (`[0]` the
    state letter, `[2]` the process group); `pid` may be "<pid>/task/<tid>".
    Empty when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return []


def status_kib(pid: int | str, name: str) -> int:
    """A `/proc/<pid>/status` counter in KiB ("VmRSS", "VmHWM"); 0 when gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(f"{name}:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def descendants(pid: int) -> list[int]:
    """Every process under `pid`, children first (a worker's ranks)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out = []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            continue
        for kid in kids:
            out += [kid, *descendants(kid)]
    return out


def _prctl():
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# Resolved here, not in the forked child: `die_with_parent` runs between fork
# and exec, where as little as possible should happen.
_PRCTL = _prctl()
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, 15, 0, 0, 0)  # SIGTERM


def die_with_parent():
    """For `subprocess.Popen(preexec_fn=die_with_parent())`: the child gets
    SIGTERM when this process dies, however it dies (SIGKILL too), so a server
    a bench or test started cannot outlive it. None (nothing to run) off the
    main thread: the kernel ties the signal to the thread that started the
    child, and a worker thread's end is not the process's. No-op off Linux."""
    import threading

    return _die_with_parent if threading.current_thread() is threading.main_thread() else None


def end_process(popen, term_wait_s: float, kill_wait_s: float) -> None:
    """SIGTERM a child still running, wait `term_wait_s`, then SIGKILL and
    wait `kill_wait_s`: every stop of a server or engine a bench started."""
    import subprocess

    if popen.poll() is not None:
        return
    popen.terminate()
    try:
        popen.wait(timeout=term_wait_s)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait(timeout=kill_wait_s)
