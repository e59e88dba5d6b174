"""The chaos cluster: `LocalCluster` (control, cache servers, prefill and
decode pools, one `kvrelay launch` process each) with short timeouts, a real
Valkey/Redis L3 and/or a file L3, and the hooks the fault injector needs:
process ids, logs scanned for unhandled errors, free-count probes, and a
gate on each worker's way to control (its heartbeats can stop alone)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
from dataclasses import dataclass, field
from pathlib import Path

from kvrelay.chaos import frames
from kvrelay.chaos.gate import Gate
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
    # The L3 of each cache server in turn: "valkey", "file" (write-through,
    # so its pages survive a kill) or "none"; "valkey,file": cache0 on
    # Valkey, cache1 on files.
    l3: str = "valkey"
    pages: int = 128  # pool pages of each worker
    staging_pages: int = 32  # small enough that a fault can fill it
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
        self.gates: dict[str, Gate] = {}  # worker name -> its gate to control

    def l3_of(self, i: int) -> str:
        kinds = self.chaos.l3.split(",")
        return kinds[i % len(kinds)]

    def l3_dir(self, i: int) -> Path:
        return self.chaos.log_dir / f"l3-{i}"

    # -- processes -------------------------------------------------------------
    def start(self) -> ChaosCluster:
        if "valkey" in self.chaos.l3.split(",") and self.chaos.cache_servers:
            self.valkey = Valkey(self.chaos.log_dir / "valkey").start()
        try:
            super().start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        # Every worker asked to stop at once (each drains and deregisters on
        # its own), then the base class waits for each and stops the rest.
        for process in self.workers():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.popen.pid, signal.SIGTERM)
        super().stop()
        for gate in self.gates.values():
            gate.stop()
        self.gates.clear()
        if self.valkey is not None:
            self.valkey.stop()

    def cache_args(self, i: int) -> list[str]:
        c, chaos = self.config, self.chaos
        args = ["launch", "cache", "--page-bytes", str(c.page_bytes),
                "--arena-gb", str(c.cache_gb / c.cache_servers), "--backend", c.backend,
                "--timeout-s", str(chaos.timeout_s)]  # fmt: skip
        if self.l3_of(i) == "valkey":
            args += ["--l3", self.valkey.url]
        elif self.l3_of(i) == "file":
            args += ["--l3", f"file:{self.l3_dir(i)}", "--l3-gb", "0.05",
                     "--l3-policy", "write-through"]  # fmt: skip
        return args

    def _start_cache(self) -> list[str]:
        started = [
            self._start(f"cache{i}", self.cache_args(i)) for i in range(self.config.cache_servers)
        ]
        self.cache_addresses = [p.wait_ready(self.config.ready_timeout_s)["listen"]
                                for p in started]  # fmt: skip
        return self.cache_addresses

    def restart_cache(self, i: int, grace_s: float = 5) -> Process:
        """A new process for cache server i on its old address (after a kill)."""
        old = self.find(f"cache{i}")
        if old is not None:
            old.stop(grace_s=grace_s)
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

    def start_pool(self, role: str, pool: PoolConfig, wait: bool = True) -> list[Process]:
        """The pool's workers, each through its gate (`LocalCluster.start_pool`)."""
        started = [self.start_worker(f"{role}{i}-tp{pool.tp}pp{pool.pp}", role, pool, wait=False)
                   for i in range(pool.workers)]  # fmt: skip
        for process in started if wait else ():
            process.wait_ready(self.config.ready_timeout_s)
        return started

    def start_worker(self, name: str, role: str, pool: PoolConfig | None = None, *,
                     wait: bool = True) -> Process:  # fmt: skip
        """Worker `name`, reaching control through its own gate (kept over restarts)."""
        gate = self.gates.get(name)
        if gate is None:
            host, port = self.control_url.removeprefix("http://").rsplit(":", 1)
            gate = self.gates[name] = Gate(host, int(port)).start()
        args = self.worker_args(role, pool or PoolConfig())
        args[args.index("--control") + 1] = gate.url
        process = self._start(name, args)
        if wait:
            process.wait_ready(self.config.ready_timeout_s)
        return process

    def restart_worker(self, victim: Process, wait: bool = True) -> Process:
        """A new process in place of a killed worker (same name and gate);
        `wait=False` returns at once (`ready` says when it serves)."""
        victim.stop(grace_s=1)
        self.processes.remove(victim)
        role = "prefill" if victim.name.startswith("prefill") else "decode"
        return self.start_worker(victim.name, role, wait=wait)

    def find(self, name: str) -> Process | None:
        return next((p for p in self.processes if p.name == name), None)

    def named(self, prefix: str) -> list[Process]:
        return [p for p in self.processes if p.name.startswith(prefix)]

    def workers(self) -> list[Process]:
        return self.named("prefill") + self.named("decode")

    def ready(self, prefix: str) -> list[Process]:
        """The processes named `prefix`... that are up and have said they serve."""
        return [p for p in self.named(prefix) if p.ready is not None and p.popen.poll() is None]

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
        for process in self.ready("prefill") + self.ready("decode"):
            s = await self.worker_stats(process)
            out[process.name] = None if s is None else (
                s["free_pages"], s["staging_free"], s["queued"], s["active"])  # fmt: skip
        return out
