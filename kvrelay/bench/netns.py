"""Two hosts on one machine: network namespaces joined by a veth pair, with
addresses from 198.18.0.0/15 (the benchmarking range), for the two-host tests
and `kvrelay bench transfer --netns`.

Creating them needs root (CAP_NET_ADMIN) and `ip` (iproute2); where either is
missing or the kernel refuses, `create` raises `NetnsUnavailable` with the
reason. `remove` kills what runs inside and deletes both (the veth pair goes
with them). A process moves itself into one with `enter`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess

SUBNET_BITS = 24
_CLONE_NEWNET = 0x40000000
_CLONE_NEWNS = 0x00020000
_MS_REC = 0x4000
_MS_SLAVE = 1 << 19
_MNT_DETACH = 2


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (no root, no `ip`, refused)."""


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def enter(name: str) -> None:
    """Move this process (call it first thing in a fresh, single-threaded one)
    into the network namespace `name`, as `ip netns exec` does: sockets live
    there, and /sys is that namespace's (UCX finds its interfaces there), in a
    mount namespace of the process's own."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        _check(libc.setns(fd, _CLONE_NEWNET), f"setns into {name}")
    finally:
        os.close(fd)
    _check(libc.unshare(_CLONE_NEWNS), "unshare the mount namespace")
    # Mounts below stay this process's: / becomes a slave of the host's.
    _check(libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None), "mount --make-rslave /")
    _check(libc.umount2(b"/sys", _MNT_DETACH), "umount /sys")
    _check(libc.mount(name.encode(), b"/sys", b"sysfs", 0, None), "mount sysfs")


class TwoHosts:
    def __init__(self, tag: str = "") -> None:
        suffix = f"{os.getpid() % 100000}{tag}"
        self.names = (f"kvr-a{suffix}", f"kvr-b{suffix}")
        self.addresses = ("198.18.0.1", "198.18.0.2")
        self._links = (f"kva{suffix}", f"kvb{suffix}")
        self.created: list[str] = []

    def _ip(self, *args: str) -> None:
        result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
        if result.returncode != 0:
            raise OSError(f"ip {' '.join(args)}: {result.stderr.strip()}")

    def create(self) -> TwoHosts:
        if shutil.which("ip") is None:
            raise NetnsUnavailable("no `ip` command (iproute2)")
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root")
        try:
            for name in self.names:
                self._ip("netns", "add", name)
                self.created.append(name)
            a, b = self._links
            self._ip("link", "add", a, "type", "veth", "peer", "name", b)
            for name, link, address in zip(self.names, self._links, self.addresses, strict=True):
                self._ip("link", "set", link, "netns", name)
                self._ip("-n", name, "addr", "add", f"{address}/{SUBNET_BITS}", "dev", link)
                self._ip("-n", name, "link", "set", link, "up")
                self._ip("-n", name, "link", "set", "lo", "up")
        except OSError as exc:
            self.remove()
            raise NetnsUnavailable(f"the kernel refused network namespaces: {exc}") from exc
        return self

    def command(self, host: int, argv: list[str]) -> list[str]:
        """`argv` run on host 0 or 1."""
        return ["ip", "netns", "exec", self.names[host], *argv]

    def remove(self) -> None:
        for name in self.created:
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True,
                                  text=True, timeout=20).stdout.split()  # fmt: skip
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)
        self.created.clear()

    def __enter__(self) -> TwoHosts:
        return self.create()

    def __exit__(self, *exc) -> None:
        self.remove()
