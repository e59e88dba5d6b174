"""What Linux's /proc says of a process, read in one place: its stat fields
(state, process group), its memory counters, its descendants. Every read is
best effort: a process may exit at any moment, and then reads as gone."""

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
