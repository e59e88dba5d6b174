"""A real Valkey or Redis server on a free loopback port (the L3 of the
chaos cluster), started and stopped like any other process of the run."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from kvrelay.cache.l3.local_server import find_server_binary as server_binary
from kvrelay.cache.l3.local_server import ping
from kvrelay.demo.cluster import free_port


class Valkey:
    def __init__(self, directory: Path, port: int = 0) -> None:
        binary = server_binary()
        if binary is None:
            raise RuntimeError("no valkey-server or redis-server on PATH")
        self.binary, self.directory = binary, directory
        self.port = port or free_port()
        self.process: subprocess.Popen | None = None
        directory.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"valkey://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> Valkey:
        if self.process is not None:  # a restart: reap the killed one first
            self.process.kill()
            self.process.wait(10)
        self.process = subprocess.Popen(
            [self.binary, "--bind", "127.0.0.1", "--port", str(self.port),
             "--dir", str(self.directory), "--save", "", "--appendonly", "no",
             "--daemonize", "no", "--logfile", str(self.directory / "server.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while not ping(self.port, 0.2):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.binary} did not answer PING within {timeout} s")
            time.sleep(0.05)
        return self

    def client(self):
        """A redis-py client of this server (KEYS, GET, SET in the faults).
        Each reply is read to its end by the protocol parser, not by waiting
        for the socket to go quiet."""
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
