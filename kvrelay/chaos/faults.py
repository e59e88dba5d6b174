"""Faults injected into a running `ChaosCluster` at a random moment of a
workload, and the checks after each: every request correct or a clear
error, none lost or hung, the free counts of every worker back to where
they started once the fault cleared, the cluster still serving.

A fault is `inject` (at a random moment while requests run) and `clear`
(after the workload, e.g. SIGCONT, a restart on the same address)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field

from kvrelay.chaos.cluster import ChaosCluster
from kvrelay.chaos.workload import CORRECT, ERROR, HUNG, LOST, WRONG, Workload
from kvrelay.demo.cluster import PoolConfig

STOP_S = 4.0  # how long a SIGSTOPped process stays stopped


def _group_signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)  # the worker and its rank processes


@dataclass(slots=True)
class FaultRow:
    fault: str
    injected: int = 0
    requests: int = 0
    outcomes: Counter = field(default_factory=Counter)
    http_5xx: int = 0
    leaked_pages: int = 0
    latencies: list = field(default_factory=list)
    not_serving: int = 0  # rounds after which a good request failed

    def as_dict(self) -> dict:
        lat = sorted(self.latencies)
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else 0.0
        return {
            "fault": self.fault, "injected": self.injected, "requests": self.requests,
            "completed_correct": self.outcomes[CORRECT], "failed_clear_error": self.outcomes[ERROR],
            "lost": self.outcomes[LOST], "hung": self.outcomes[HUNG],
            "wrong_tokens": self.outcomes[WRONG], "http_5xx": self.http_5xx,
            "leaked_pages": self.leaked_pages, "p99_latency_s": round(p99, 3),
            "not_serving_after": self.not_serving,
        }  # fmt: skip


class Faults:
    """The catalogue: name -> (inject, clear) on a cluster."""

    def __init__(self, cluster: ChaosCluster, rng: random.Random) -> None:
        self.cluster = cluster
        self.rng = rng
        self._victim = None
        self._snapshot = None

    def names(self) -> list[str]:
        names = ["kill_prefill", "stop_prefill", "kill_decode", "stop_decode",
                 "kill_cache", "stop_cache", "burst"]  # fmt: skip
        if self.cluster.valkey is not None:
            names += ["kill_valkey", "stop_valkey", "corrupt_valkey"]
        return names

    def _pick(self, prefix: str):
        return self.rng.choice(self.cluster.named(prefix))

    # -- inject ---------------------------------------------------------------------
    def inject(self, name: str) -> None:
        kind, _, target = name.partition("_")
        if kind in ("kill", "stop") and target in ("prefill", "decode", "cache"):
            self._victim = self._pick(target)
            sig = signal.SIGKILL if kind == "kill" else signal.SIGSTOP
            _group_signal(self._victim.popen.pid, sig)
        elif name == "kill_valkey":
            self.cluster.valkey.process.kill()
        elif name == "stop_valkey":
            self.cluster.valkey.process.send_signal(signal.SIGSTOP)
        elif name == "corrupt_valkey":
            self._corrupt_valkey()
        elif name == "burst":
            pass  # the workload itself is the fault: see `sessions_for`
        else:
            raise ValueError(f"unknown fault {name!r}")

    def _corrupt_valkey(self) -> None:
        """Flip bytes in the middle of every stored record (a checksum must catch it)."""
        valkey = self.cluster.valkey
        reply = valkey.command("KEYS", "*")
        keys = [line for line in reply.split(b"\r\n") if line and line[:1] not in b"*$"]
        for key in keys[:200]:
            value = valkey.command("GET", key)
            body = value.split(b"\r\n", 1)[-1][:-2] if value.startswith(b"$") else b""
            if len(body) > 8:
                middle = len(body) // 2
                spoiled = body[:middle] + bytes([body[middle] ^ 0xFF]) + body[middle + 1 :]
                valkey.command("SET", key, spoiled)

    def sessions_for(self, name: str, sessions: int) -> int:
        return sessions * 4 if name == "burst" else sessions

    # -- clear ----------------------------------------------------------------------
    def clear(self, name: str) -> None:
        kind, _, target = name.partition("_")
        victim, self._victim = self._victim, None
        if kind == "stop" and target in ("prefill", "decode", "cache"):
            _group_signal(victim.popen.pid, signal.SIGCONT)
        elif kind == "kill" and target in ("prefill", "decode"):
            victim.stop(grace_s=1)
            self.cluster.processes.remove(victim)
            process = self.cluster._start(victim.name, self.cluster.worker_args(
                target, PoolConfig()))  # fmt: skip
            process.wait_ready(self.cluster.config.ready_timeout_s)
        elif name == "kill_cache":
            self.cluster.restart_cache(int(victim.name.removeprefix("cache")))
        elif name == "kill_valkey":
            self.cluster.valkey.start()  # same port and directory
        elif name == "stop_valkey":
            self.cluster.valkey.process.send_signal(signal.SIGCONT)


async def settled_counts(cluster: ChaosCluster, baseline: dict, timeout_s: float) -> int:
    """Waits until each worker's free pool pages and staging rows are back at
    `baseline` (by name) and nothing is queued or active; the pages still
    missing at the deadline (the leak)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = await cluster.free_counts()
        missing = 0
        for name, start in baseline.items():
            got = now.get(name)
            if start is None:
                continue
            if got is None:  # not answering (yet): count it until the deadline
                missing += 1
                continue
            missing += max(0, start[0] - got[0]) + max(0, start[1] - got[1]) + got[2] + got[3]
        if not missing or time.monotonic() > deadline:
            return missing
        await asyncio.sleep(0.5)


async def fault_round(cluster: ChaosCluster, faults: Faults, workload: Workload, name: str,
                      row: FaultRow, *, sessions: int, turns: int) -> None:  # fmt: skip
    """One injection of `name` at a random moment of a workload."""
    baseline = await cluster.free_counts()
    before = len(workload.outcomes)
    run = asyncio.create_task(workload.run(faults.sessions_for(name, sessions), turns))
    await asyncio.sleep(faults.rng.uniform(0.05, 0.6))  # while requests run
    await asyncio.to_thread(faults.inject, name)
    row.injected += 1
    if name.startswith("stop"):
        await asyncio.sleep(STOP_S)
        await asyncio.to_thread(faults.clear, name)
        await run
    else:
        await run
        await asyncio.to_thread(faults.clear, name)
    outcomes = workload.outcomes[before:]
    row.requests += len(outcomes)
    for outcome in outcomes:
        row.outcomes[outcome.kind] += 1
        row.http_5xx += outcome.status >= 500
        row.latencies.append(outcome.latency_s)
    row.leaked_pages += await settled_counts(cluster, baseline, timeout_s=45)
    good = await workload.run(1, 1)
    row.not_serving += good[0].kind != CORRECT
