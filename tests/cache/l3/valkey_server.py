"""A real Valkey or Redis server on a free loopback port, for tests."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

BINARIES = ("valkey-server", "redis-server")


def server_binary() -> str:
    """The server binary; skipped outside CI when none is installed, a failure in CI."""
    for name in BINARIES:
        path = shutil.which(name)
        if path:
            return path
    message = (
        "no valkey-server or redis-server on PATH "
        "(apt-get install -y redis-server; .ci/run installs it)"
    )
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ping(port: int, timeout: float) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class ValkeyServer:
    def __init__(self, directory: Path) -> None:
        self.binary = server_binary()
        self.directory = directory
        self.port = free_port()
        self.process: subprocess.Popen | None = None
        self.extra_args: list[str] = []

    def start(self, timeout: float = 10.0) -> None:
        self.process = subprocess.Popen(
            [
                self.binary,
                "--bind", "127.0.0.1",
                "--port", str(self.port),
                "--dir", str(self.directory),
                "--save", "",
                "--appendonly", "no",
                "--daemonize", "no",
                "--logfile", str(self.directory / "server.log"),
                *self.extra_args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                log = (self.directory / "server.log").read_text(errors="replace")
                raise RuntimeError(f"{self.binary} exited {self.process.returncode}: {log[-2000:]}")
            if _ping(self.port, 0.2):
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.binary} did not answer PING within {timeout} s")

    def pause(self) -> None:
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.send_signal(signal.SIGCONT)
        self.process.kill()
        self.process.wait(timeout=10)
        self.process = None
