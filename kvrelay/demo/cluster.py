"""A whole kvrelay cluster on one machine: control, cache servers, prefill and
decode pools, each a `kvrelay launch ...` process with its own log.

Every process starts in a session of its own, so stopping it (SIGTERM, then
SIGKILL after a grace period) also reaches the rank processes it spawned.
Each server prints one JSON line when it is ready; a reader thread copies the
process's output to its log and catches that line.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvrelay.layout import DEFAULT_PAGE_SIZE
from kvrelay.ports import free_port


class ClusterError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """One pool of identical workers: `workers` processes groups of tp x pp ranks."""

    workers: int = 1
    tp: int = 1
    pp: int = 1
    device: str = "cpu"  # the first rank's (`kvrelay launch --device`)
    staging: str = ""  # "device" or "pinned" for GPU pools; "" = the worker's default

    @classmethod
    def parse(cls, text: str) -> PoolConfig:
        """'2xtp2', 'tp1pp2', '3', 'tp=2,pp=1,workers=2' all work."""
        values = {"workers": 1, "tp": 1, "pp": 1}
        cleaned = text.replace("=", "").replace(",", " ").replace("x", " ").split()
        for part in cleaned:
            for name in ("workers", "tp", "pp"):
                if part.startswith(name) and part[len(name) :].isdigit():
                    values[name] = int(part[len(name) :])
                    break
            else:
                if part.isdigit():
                    values["workers"] = int(part)
                elif part.startswith("tp") and "pp" in part:
                    tp, pp = part[2:].split("pp")
                    values["tp"], values["pp"] = int(tp), int(pp)
                else:
                    raise ValueError(f"cannot read pool config {text!r}")
        if min(values.values()) < 1:
            raise ValueError(f"pool config {text!r}: every number must be >= 1")
        return cls(**values)

    def label(self) -> str:
        return f"{self.workers}x TP={self.tp} PP={self.pp}"


@dataclass(slots=True)
class Process:
    name: str
    popen: subprocess.Popen
    log: Path
    ready: dict | None = None
    _ready_event: threading.Event = field(default_factory=threading.Event)
    _pump: threading.Thread | None = None

    def wait_ready(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while not self._ready_event.wait(0.2):
            if self.popen.poll() is not None:
                raise ClusterError(
                    f"{self.name} exited with {self.popen.returncode} before it was ready; "
                    f"see {self.log}:\n{_tail(self.log)}"
                )
            if time.monotonic() > deadline:
                raise ClusterError(f"{self.name} not ready in {timeout_s:.0f} s; see {self.log}")
        return self.ready

    def terminate(self) -> None:
        """SIGTERM, without waiting (`stop` waits)."""
        if self.popen.poll() is None:
            _signal_group(self.popen.pid, signal.SIGTERM)

    def stop(self, grace_s: float = 20.0) -> None:
        if self.popen.poll() is None:
            _signal_group(self.popen.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=grace_s)
        # Rank processes live in the same session: take down anything left.
        _signal_group(self.popen.pid, signal.SIGKILL)
        if self.popen.poll() is None:
            self.popen.wait(timeout=10)
        if self._pump is not None:
            self._pump.join(timeout=5)  # the pipe ends when the process group is gone
        self.popen.stdout.close()


def _stop_together(processes: list[Process]) -> None:
    """SIGTERM to all, then waits for each: their shutdowns overlap."""
    for process in processes:
        process.terminate()
    for process in processes:
        process.stop()


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _pump(process: Process) -> None:
    with open(process.log, "a", encoding="utf-8") as log:
        for line in process.popen.stdout:
            log.write(line)
            log.flush()
            if process.ready is None and line.startswith("{"):
                try:
                    process.ready = json.loads(line)
                except json.JSONDecodeError:
                    continue
                process._ready_event.set()


@dataclass(slots=True)
class ClusterConfig:
    model_dir: Path
    log_dir: Path
    token: str = "kvrelay-demo"
    prefill: PoolConfig = field(default_factory=lambda: PoolConfig(workers=1, tp=2))
    decode: PoolConfig = field(default_factory=PoolConfig)
    cache: str = "shared"  # "shared": a cache server tier; "local": pools only; "none"
    cache_servers: int = 1
    cache_gb: float = 0.5
    page_bytes: int = 0  # of the model's unified page; needed with a cache tier
    page_size: int = DEFAULT_PAGE_SIZE
    dtype: str = "float32"
    prefill_pages: int = 1024
    decode_pages: int = 2048
    backend: str = "tcp"
    control_port: int = 0  # 0: a free port
    ready_timeout_s: float = 120.0
    extra_env: dict = field(default_factory=dict)
    speculative: int = 0  # MTP draft tokens per step (decode); prefill moves draft pages
    max_prefill_tokens: int = 0  # workers' tokens per prefill forward (0: their default)
    # A long cold prompt's prefill on a CPU takes minutes: control's attempt
    # and request deadlines and the workers' rank deadline (0: their defaults).
    slow_prefill_s: float = 0.0


class LocalCluster:
    """Control + cache servers + prefill and decode pools on 127.0.0.1."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.processes: list[Process] = []
        self.control_url = ""
        self.cache_addresses: list[str] = []
        config.log_dir.mkdir(parents=True, exist_ok=True)

    # -- processes --------------------------------------------------------
    def _start(self, name: str, args: list[str]) -> Process:
        # The token goes by environment, not argv: a command line is in every
        # process listing and at the top of each log.
        env = os.environ | {"PYTHONUNBUFFERED": "1", "KVRELAY_TOKEN": self.config.token}
        env |= self.config.extra_env
        log = self.config.log_dir / f"{name}.log"
        log.write_text(f"$ kvrelay {' '.join(args)}\n")
        popen = subprocess.Popen(
            [sys.executable, "-m", "kvrelay.cli", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
            start_new_session=True,
        )
        process = Process(name, popen, log)
        process._pump = threading.Thread(target=_pump, args=(process,), daemon=True)
        process._pump.start()
        self.processes.append(process)
        return process

    def start(self) -> LocalCluster:
        c = self.config
        try:
            port = c.control_port or free_port()
            args = ["launch", "control", "--listen", f"127.0.0.1:{port}"]
            if c.cache == "shared":
                args += ["--cache", ",".join(self._start_cache())]
            if c.slow_prefill_s:
                args += ["--attempt-timeout-s", str(c.slow_prefill_s),
                         "--request-timeout-s", str(2 * c.slow_prefill_s)]  # fmt: skip
            self._start("control", args).wait_ready(c.ready_timeout_s)
            self.control_url = f"http://127.0.0.1:{port}"
            # Both pools at once: their processes import torch and load the
            # model side by side instead of one pool after the other.
            started = [*self.start_pool("prefill", c.prefill, wait=False),
                       *self.start_pool("decode", c.decode, wait=False)]  # fmt: skip
            for process in started:
                process.wait_ready(c.ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_cache(self) -> list[str]:
        c = self.config
        if c.page_bytes <= 0:
            raise ClusterError("a shared cache tier needs the model's page_bytes")
        started = []
        for i in range(c.cache_servers):
            started.append(self._start(f"cache{i}", [
                "launch", "cache", "--page-bytes", str(c.page_bytes),
                "--arena-gb", str(c.cache_gb / c.cache_servers), "--backend", c.backend,
            ]))  # fmt: skip
        self.cache_addresses = [p.wait_ready(c.ready_timeout_s)["listen"] for p in started]
        return self.cache_addresses

    def worker_args(self, role: str, pool: PoolConfig) -> list[str]:
        c = self.config
        args = [
            "launch", role, "--model", str(c.model_dir), "--tp", str(pool.tp),
            "--pp", str(pool.pp), "--control", self.control_url,
            "--backend", c.backend, "--page-size", str(c.page_size), "--dtype", c.dtype,
            "--num-pages", str(c.prefill_pages if role == "prefill" else c.decode_pages),
        ]  # fmt: skip
        if c.max_prefill_tokens:
            args += ["--max-prefill-tokens", str(c.max_prefill_tokens)]
        if c.slow_prefill_s:
            args += ["--rank-timeout-s", str(c.slow_prefill_s)]
        if pool.device != "cpu":
            args += ["--device", pool.device]
        if pool.staging:
            args += ["--staging", pool.staging]
        if c.cache == "shared":
            args += ["--cache", ",".join(self.cache_addresses)]
            if role == "decode":
                args.append("--write-back")
        elif c.cache == "none":
            args.append("--no-local-cache")
        if c.speculative:  # prefill: computes, stages and writes the draft pages too
            args += ["--speculative", str(c.speculative)]
        return args

    def start_pool(self, role: str, pool: PoolConfig, wait: bool = True) -> list[Process]:
        """The pool's workers, started side by side; `wait`: until each is ready."""
        started = []
        for i in range(pool.workers):
            name = f"{role}{i}-tp{pool.tp}pp{pool.pp}"
            started.append(self._start(name, self.worker_args(role, pool)))
        for process in started if wait else ():
            process.wait_ready(self.config.ready_timeout_s)
        return started

    def stop_pool(self, role: str) -> None:
        pool = [p for p in self.processes if p.name.startswith(role)]
        _stop_together(pool)
        for process in pool:
            self.processes.remove(process)

    def redeploy(self, role: str, pool: PoolConfig) -> None:
        """Replace a pool by one of another parallel config."""
        self.stop_pool(role)
        self.start_pool(role, pool)

    def stop(self) -> None:
        # Workers first (they deregister), then the cache servers, then
        # control; the processes of each step stop side by side.
        servers = ("cache", "control")
        _stop_together([p for p in self.processes if not p.name.startswith(servers)])
        for server in servers:
            _stop_together([p for p in self.processes if p.name.startswith(server)])
        self.processes.clear()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
