"""`kvrelay launch cache`: run one cache server until SIGTERM or SIGINT;
`CacheServerProcess` starts one as a child process (tests, benches)."""

from __future__ import annotations

import argparse
import asyncio
import json
import select
import signal
import subprocess
import sys
import time

from kvrelay import options, procfs
from kvrelay.cache.server import CacheServer, CacheServerConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_arguments(parser, CacheServerConfig)


def run(args: argparse.Namespace) -> None:
    asyncio.run(_serve(options.from_args(CacheServerConfig, args)))


async def _serve(config: CacheServerConfig) -> None:
    server = await CacheServer(config).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # One JSON line tells whoever started the server where it listens.
    print(json.dumps({"listen": server.address, "agent": server.agent.address}), flush=True)
    try:
        await stop.wait()
    finally:
        await server.close()


class CacheServerProcess:
    """`kvrelay launch cache` in a process of its own: an L2 arena of `pages`
    pages of `page_bytes`, more flags in `args`; `address` is where it listens."""

    def __init__(self, *args: str, token: str, page_bytes: int, pages: int = 64,
                 listen: str = "127.0.0.1:0", backend: str = "tcp",
                 start_timeout_s: float = 60.0) -> None:  # fmt: skip
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvrelay.cli", "launch", "cache", "--token", token,
             "--page-bytes", str(page_bytes), "--arena-gb", str(pages * page_bytes / (1 << 30)),
             "--listen", listen, "--backend", backend, *args],
            stdout=subprocess.PIPE,
            # A test or bench killed outright takes its servers with it.
            preexec_fn=procfs.die_with_parent(),
        )  # fmt: skip
        ready, _, _ = select.select([self.process.stdout], [], [], start_timeout_s)
        if not ready:
            self.process.kill()
            self.process.wait(5)
            raise RuntimeError(f"cache server did not start within {start_timeout_s:.0f} s")
        self.address = json.loads(self.process.stdout.readline())["listen"]

    def stop(self, sig=signal.SIGTERM) -> None:
        """Sends `sig` (a stopped server is resumed first), waits, kills after 15 s."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.send_signal(sig)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self.process.stdout.close()

    def pause(self, timeout_s: float = 10.0) -> None:
        """SIGSTOP, and wait until the kernel shows the process stopped (Linux
        `/proc`), so that nothing it answers can race the caller's next step."""
        self.process.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + timeout_s
        while procfs.stat_fields(self.process.pid)[:1] not in (["T"], ["t"]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"cache server {self.process.pid} did not stop in {timeout_s} s")
            time.sleep(0.005)

    def kill(self, timeout_s: float = 10.0) -> None:
        """SIGKILL, and wait until the process is gone (its sockets closed)."""
        self.process.kill()
        self.process.wait(timeout_s)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)
