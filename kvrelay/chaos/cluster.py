"""The chaos cluster: `LocalCluster` (control, cache servers, prefill and
decode pools, one `kvrelay launch` process each) with short timeouts, a real
Valkey/Redis L3 (or a file L3), and the hooks the fault injector needs:
process ids, logs scanned for unhandled errors, free-count probes."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from kvrelay.chaos import frames
from kvrelay.chaos.valkey import Valkey
from kvrelay.demo.cluster import ClusterConfig, LocalCluster, PoolConfig, Process

# What an unhandled error looks like in a process log.
UNHANDLED = re.compile(r"Traceback \(most recent call last\)|exception was never retrieved")


@dataclass(slots=True)
class ChaosConfig:
    model_dir: Path
    log_dir: Path
    page_bytes: int
    token: str = "kvrelay-chaos-token"
    page_size: int = 16
    dtype: str = "float64"
    prefill_workers: int = 2
    decode_workers: int = 2
    cache_servers: int = 2
    l3: str = "valkey"  # "valkey", "file" or "none"
    pages: int = 128  # pool pages of each worker
    staging_pages: int = 0
    max_queue: int = 16
    timeout_s: float = 2.0  # hello/stall deadlines of every listener
    transfer_timeout_s: float = 3.0
    request_timeout_s: float = 30.0
    extra_worker_args: list[str] = field(default_factory=list)


class ChaosCluster(LocalCluster):
    def __init__(self, chaos: ChaosConfig) -> None:
        super().__init__(ClusterConfig(
            model_dir=chaos.model_dir, log_dir=chaos.log_dir, token=chaos.token,
            prefill=PoolConfig(workers=chaos.prefill_workers),
            decode=PoolConfig(workers=chaos.decode_workers),
            cache="shared" if chaos.cache_servers else "local",
            cache_servers=chaos.cache_servers, cache_gb=chaos.cache_servers * 256 * chaos.page_bytes
            / (1 << 30), page_bytes=chaos.page_bytes, page_size=chaos.page_size,
            dtype=chaos.dtype, prefill_pages=chaos.pages, decode_pages=chaos.pages,
        ))  # fmt: skip
        self.chaos = chaos
        self.valkey: Valkey | None = None

    # -- processes -------------------------------------------------------------
    def start(self) -> ChaosCluster:
        if self.chaos.l3 == "valkey" and self.chaos.cache_servers:
            self.valkey = Valkey(self.chaos.log_dir / "valkey").start()
        try:
            super().start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        super().stop()
        if self.valkey is not None:
            self.valkey.stop()

    def cache_args(self, i: int) -> list[str]:
        c, chaos = self.config, self.chaos
        args = ["launch", "cache", "--page-bytes", str(c.page_bytes),
                "--arena-gb", str(c.cache_gb / c.cache_servers), "--backend", c.backend,
                "--timeout-s", str(chaos.timeout_s)]  # fmt: skip
        if chaos.l3 == "valkey":
            args += ["--l3", self.valkey.url]
        elif chaos.l3 == "file":
            args += ["--l3", f"file:{chaos.log_dir / f'l3-{i}'}", "--l3-gb", "0.05"]
        return args

    def _start_cache(self) -> list[str]:
        started = [
            self._start(f"cache{i}", self.cache_args(i)) for i in range(self.config.cache_servers)
        ]
        self.cache_addresses = [p.wait_ready(self.config.ready_timeout_s)["listen"]
                                for p in started]  # fmt: skip
        return self.cache_addresses

    def restart_cache(self, i: int) -> Process:
        """A new process for cache server i on its old address (after a kill)."""
        old = self.find(f"cache{i}")
        if old is not None:
            old.stop(grace_s=5)
            self.processes.remove(old)
        host_port = self.cache_addresses[i]
        process = self._start(f"cache{i}", [*self.cache_args(i), "--listen", host_port])
        process.wait_ready(self.config.ready_timeout_s)
        return process

    def worker_args(self, role: str, pool: PoolConfig) -> list[str]:
        chaos = self.chaos
        args = super().worker_args(role, pool)
        args += ["--hello-timeout-s", str(chaos.timeout_s), "--max-queue", str(chaos.max_queue),
                 "--transfer-timeout-s", str(chaos.transfer_timeout_s)]  # fmt: skip
        if chaos.staging_pages:
            args += ["--staging-pages", str(chaos.staging_pages)]
        return [*args, *chaos.extra_worker_args]

    def find(self, name: str) -> Process | None:
        return next((p for p in self.processes if p.name == name), None)

    def named(self, prefix: str) -> list[Process]:
        return [p for p in self.processes if p.name.startswith(prefix)]

    def unhandled_errors(self) -> dict[str, int]:
        """Process name -> unhandled errors in its log (0 for a clean log)."""
        out = {}
        for path in self.config.log_dir.glob("*.log"):
            out[path.stem] = len(UNHANDLED.findall(path.read_text(errors="replace")))
        return out

    # -- state probes ----------------------------------------------------------------
    async def worker_stats(self, process: Process) -> dict | None:
        try:
            reply = await frames.call(process.ready["address"], {"op": "stats"},
                                      self.config.token, timeout=10)  # fmt: skip
        except (OSError, TimeoutError):
            return None
        return reply.get("stats") if frames.accepted(reply) else None

    async def cache_stats(self, address: str) -> dict | None:
        try:
            reply = await frames.call(address, {"op": "stats"}, self.config.token, timeout=10)
        except (OSError, TimeoutError):
            return None
        return reply if frames.accepted(reply) else None

    async def free_counts(self) -> dict[str, tuple]:
        """Per worker: (free pool pages, free staging rows, queued, active)."""
        out = {}
        for process in self.named("prefill") + self.named("decode"):
            s = await self.worker_stats(process)
            out[process.name] = None if s is None else (
                s["free_pages"], s["staging_free"], s["queued"], s["active"])  # fmt: skip
        return out


def children(pid: int) -> list[int]:
    """Every descendant of `pid` (a worker's rank processes)."""
    out = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            continue
        for kid in kids:
            out += [kid, *children(kid)]
    return out
