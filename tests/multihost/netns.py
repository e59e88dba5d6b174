"""Two hosts on one machine: network namespaces joined by a veth pair, with
addresses from 198.18.0.0/15 (the benchmarking range), for tests.

Creating them needs root (CAP_NET_ADMIN); where the kernel or the sandbox
refuses, the tests skip with the refusal as the reason. Everything is removed
on exit, processes left inside first.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess

import pytest

SUBNET_BITS = 24


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
            pytest.skip("no `ip` command (iproute2)")
        if os.geteuid() != 0:
            pytest.skip("network namespaces need root")
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
            pytest.skip(f"the kernel refused network namespaces: {exc}")
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
        self.created.clear()  # the veth pair goes with its namespaces
