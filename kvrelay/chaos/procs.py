"""What a process of the cluster is doing right now, read from /proc, so a
fault can be timed to a moment of a request: a rank computing (a thread in
state R), a request sent to a server and not yet read by it (bytes waiting
in the server side's receive queue, from a socket a given process owns).

Linux only; every read is best effort (a process may exit at any time)."""

from __future__ import annotations

import os

from kvrelay.procfs import descendants, stat_fields

ESTABLISHED, LISTEN = "01", "0A"


def group_pids(pid: int) -> list[int]:
    """A worker's front and every process under it (ranks, their trackers)."""
    return [pid, *descendants(pid)]


def rank_pids(pid: int) -> list[int]:
    """The rank processes under a worker's front (spawned multiprocessing
    children; the resource tracker is not a rank)."""
    out = []
    for kid in descendants(pid):
        try:
            with open(f"/proc/{kid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            out.append(kid)
    return out


def running(pid: int) -> bool:
    """A thread of `pid` is on a CPU or waiting for one (state R)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    return any(stat_fields(f"{pid}/task/{task}")[:1] == ["R"] for task in tasks)


def _socket_inodes(pids: list[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    return inodes


def _tcp_rows() -> list[tuple[int, int, str, int, str]]:
    """(local port, remote port, state, unread bytes, inode) of every IPv4 TCP socket."""
    rows = []
    try:
        with open("/proc/net/tcp") as f:
            next(f)
            for line in f:
                parts = line.split()
                local, remote, state, queues, inode = (parts[i] for i in (1, 2, 3, 4, 9))
                rx = int(queues.split(":")[1], 16)
                rows.append((int(local.split(":")[1], 16), int(remote.split(":")[1], 16), state,
                             rx, inode))  # fmt: skip
    except OSError:
        pass
    return rows


def unread_bytes(server_pids: list[int], client_pids: list[int],
                 ports: set[int] | None = None) -> int:  # fmt: skip
    """Bytes that processes `client_pids` sent to a listening socket of
    `server_pids` (one of `ports` if given) and the server has not read yet:
    a request in flight that the server has not started on. Connections not
    yet accepted count too (their socket is in no process's table)."""
    rows = _tcp_rows()
    server_inodes, client_inodes = _socket_inodes(server_pids), _socket_inodes(client_pids)
    listening = {lp for lp, _, st, _, inode in rows if st == LISTEN and inode in server_inodes}
    if ports is not None:
        listening &= ports
    client_ports = {lp for lp, _, st, _, inode in rows if inode in client_inodes}
    return sum(rx for lp, rp, st, rx, _ in rows
               if st == ESTABLISHED and lp in listening and rp in client_ports)  # fmt: skip
