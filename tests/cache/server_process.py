"""Cache server processes started through the CLI (`kvrelay launch cache`), for tests."""

import json
import select
import signal
import subprocess
import sys

from tests.cache.specs import SPEC

TOKEN = "cache-test"
PAGE = SPEC.page_bytes


class ServerProcess:
    def __init__(self, *args: str, listen: str = "127.0.0.1:0", backend: str = "tcp") -> None:
        self.args = args
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvrelay.cli", "launch", "cache", "--token", TOKEN,
             "--page-bytes", str(PAGE), "--arena-gb", str(64 * PAGE / (1 << 30)),
             "--listen", listen, "--backend", backend, *args],
            stdout=subprocess.PIPE,
        )  # fmt: skip
        ready, _, _ = select.select([self.process.stdout], [], [], 60)
        if not ready:
            self.process.kill()
            raise RuntimeError("cache server did not start within 60 s")
        self.address = json.loads(self.process.stdout.readline())["listen"]

    def stop(self, sig=signal.SIGTERM) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.send_signal(sig)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self.process.stdout.close()

    def pause(self) -> None:
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)
