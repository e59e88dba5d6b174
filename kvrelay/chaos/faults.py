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

import httpx

from kvrelay.chaos.cluster import ChaosCluster
from kvrelay.chaos.moments import TIMED, Moments, until
from kvrelay.chaos.persistence import FILE_FAULTS, FileL3Faults
from kvrelay.chaos.pressure import Pressure
from kvrelay.chaos.workload import CORRECT, ERROR, HUNG, LOST, WRONG, Workload

STOP_S = 4.0  # how long a SIGSTOPped process stays stopped
MAX_VALKEY_RECORDS = 5000  # records spoiled by one corrupt_valkey (all of a round's)
HEARTBEATS_OFF_S = 4.5  # past control's 3 missed heartbeats of 1 s: the node is removed


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
    at_moment: int = 0  # injections that struck at their moment (see `moments`)
    problems_after: int = 0  # checks after the fault failed (see `Faults.after`)
    checks_skipped: int = 0  # checks after the fault with nothing to check (file L3)
    harness_errors: int = 0  # rounds the harness itself could not finish (bench only)
    phase_s: Counter = field(default_factory=Counter)  # wall seconds per phase of a round
    errors: Counter = field(default_factory=Counter)  # "status reason" of each failed request

    def as_dict(self) -> dict:
        lat = sorted(self.latencies)
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else 0.0
        return {
            "fault": self.fault, "injected": self.injected, "requests": self.requests,
            "completed_correct": self.outcomes[CORRECT], "failed_clear_error": self.outcomes[ERROR],
            "lost": self.outcomes[LOST], "hung": self.outcomes[HUNG],
            "wrong_tokens": self.outcomes[WRONG], "http_5xx": self.http_5xx,
            "leaked_pages": self.leaked_pages, "p99_latency_s": round(p99, 3),
            "not_serving_after": self.not_serving, "at_moment": self.at_moment,
            "problems_after": self.problems_after, "harness_errors": self.harness_errors,
            "checks_skipped": self.checks_skipped,
            "phase_s": {k: round(v, 1) for k, v in self.phase_s.items()},
            "errors": dict(self.errors.most_common(8)),
        }  # fmt: skip


class Faults:
    """The catalogue: name -> inject (at a random moment of a workload),
    clear (once the workload ended, or after a hold for a freeze), after
    (checks that need the fault cleared)."""

    def __init__(self, cluster: ChaosCluster, rng: random.Random,
                 background_restarts: bool = False) -> None:  # fmt: skip
        self.cluster = cluster
        self.rng = rng
        # A killed worker's replacement starts while the next rounds run
        # (`ready_for` keeps a fault from striking a pool's last worker).
        self.background_restarts = background_restarts
        self._victim = None
        self.moments = Moments(cluster, rng)
        self.pressure = Pressure(cluster, rng)
        self.files = FileL3Faults(cluster, rng)

    def names(self) -> list[str]:
        names = ["kill_prefill", "stop_prefill", "kill_decode", "stop_decode",
                 "kill_cache", "stop_cache", "burst", "stop_heartbeats", *TIMED,
                 "fill_cache", "full_staging", "full_decode_pool"]  # fmt: skip
        if self.cluster.valkey is not None:
            names += ["kill_valkey", "stop_valkey", "corrupt_valkey"]
        if self.files.servers:
            names += list(FILE_FAULTS)
        return names

    def _pick(self, prefix: str):
        return self.rng.choice(self.cluster.ready(prefix))

    def is_ready(self, name: str) -> bool:
        """Each pool has a worker serving, and every worker of a pool this
        fault kills or freezes does (so it never takes a pool's last)."""
        roles = [r for r in ("prefill", "decode") if r in name] or ["prefill", "decode"]
        strict = [r for r in ("prefill", "decode") if r in name or "heartbeats" in name]
        return all(self.cluster.ready(r) for r in roles) and all(
            len(self.cluster.ready(r)) == len(self.cluster.named(r)) for r in strict
        )

    async def ready_for(self, name: str, timeout_s: float = 300.0) -> None:
        """Waits until `is_ready(name)`; the round begins then."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.is_ready(name):
                self.files.begin()
                return
            await asyncio.sleep(0.2)
        raise TimeoutError(f"{name}: the cluster's workers are not all serving")

    def hold_s(self, name: str) -> float:
        """How long a freeze lasts before `clear` (0: cleared after the workload)."""
        return STOP_S if name.startswith("stop") else 0.0

    # -- inject ---------------------------------------------------------------------
    async def inject(self, name: str, workload: Workload) -> bool:
        """Strikes; whether it struck at its moment (always, for untimed faults)."""
        if name in TIMED:
            self._victim, at = await self.moments.strike(name)
            return at
        if name in ("fill_cache", "full_staging", "full_decode_pool"):
            return await self.pressure.inject(name, workload)
        if name in FILE_FAULTS:
            return await asyncio.to_thread(self.files.inject, name)
        if name == "stop_heartbeats":
            self._victim = self.rng.choice(
                self.cluster.ready("prefill") + self.cluster.ready("decode")
            )
            await asyncio.to_thread(self.cluster.gates[self._victim.name].close)
            return True
        await asyncio.to_thread(self._inject_signal, name)
        return True

    def _inject_signal(self, name: str) -> None:
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
        """Flip a byte in the middle of every stored record (a checksum must catch it)."""
        with self.cluster.valkey.client() as client:
            keys = list(client.scan_iter(count=1000))[:MAX_VALKEY_RECORDS]
            values = client.mget(keys) if keys else []
            pipe = client.pipeline(transaction=False)
            for key, body in zip(keys, values, strict=True):
                if body is not None and len(body) > 8:
                    middle = len(body) // 2
                    spoiled = body[:middle] + bytes([body[middle] ^ 0xFF]) + body[middle + 1 :]
                    pipe.set(key, spoiled, keepttl=True)
            pipe.execute()

    def sessions_for(self, name: str, sessions: int) -> int:
        """A burst is 4x the sessions; a timed kill gets enough traffic for its moment."""
        if name in ("burst", "kill_prefill_queued"):
            return sessions * 4
        return sessions * 2 if name in TIMED else sessions

    # -- clear ----------------------------------------------------------------------
    async def clear(self, name: str) -> None:
        if name in ("fill_cache", "full_staging", "full_decode_pool"):
            await self.pressure.clear(name)
        elif name in TIMED:
            await self.moments.settle()
        await asyncio.to_thread(self._clear, name)

    def _clear(self, name: str) -> None:
        kind, _, target = name.partition("_")
        victim, self._victim = self._victim, None
        if name == "stop_heartbeats":
            self.cluster.gates[victim.name].open()
        elif kind == "stop" and target in ("prefill", "decode", "cache"):
            _group_signal(victim.popen.pid, signal.SIGCONT)
        elif victim is not None and victim.name.startswith("cache"):
            self.cluster.restart_cache(int(victim.name.removeprefix("cache")))
        elif kind == "kill" and victim is not None:  # a worker, plain or timed
            self.cluster.restart_worker(victim, wait=not self.background_restarts)
        elif name == "kill_valkey":
            self.cluster.valkey.start()  # same port and directory
        elif name == "stop_valkey":
            self.cluster.valkey.process.send_signal(signal.SIGCONT)

    async def after(self, name: str, victim, workload: Workload, sessions: int,
                    turns: int) -> int:  # fmt: skip
        """Problems found once the fault is cleared (0: none)."""
        if name in FILE_FAULTS:
            return await self.files.after(name, workload, sessions, turns)
        if name == "fill_cache":
            return await self.pressure.after(name)
        if name == "stop_heartbeats":
            return int(not await until(lambda: self._live(victim), 30.0))
        return 0

    async def _live(self, worker) -> bool:
        """Control lists `worker` live again (it registered after the gate opened)."""
        try:
            async with httpx.AsyncClient(base_url=self.cluster.control_url, timeout=5) as client:
                nodes = (await client.get("/stats")).json()["nodes"]
        except (httpx.HTTPError, ValueError, KeyError):
            return False
        address = worker.ready["address"]
        return any(n["address"] == address and n["state"] == "live" for n in nodes)

    async def close(self) -> None:
        await self.moments.close()


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
                process = cluster.find(name)
                restarting = process is not None and process.ready is None
                missing += not restarting  # a new process (killed, restarted) holds nothing
                continue
            missing += max(0, start[0] - got[0]) + max(0, start[1] - got[1]) + got[2] + got[3]
        if not missing or time.monotonic() > deadline:
            return missing
        await asyncio.sleep(0.5)


async def fault_round(cluster: ChaosCluster, faults: Faults, workload: Workload, name: str,
                      row: FaultRow, *, sessions: int, turns: int) -> None:  # fmt: skip
    """One injection of `name` at a random moment of a workload."""
    clock = _Phases(row.phase_s)
    await faults.ready_for(name)
    clock("ready")
    baseline = await cluster.free_counts()
    before = len(workload.outcomes)
    # New prompts each round: pools miss, so lookups and writes reach the tier.
    workload.seed = faults.rng.getrandbits(31)
    run = asyncio.create_task(workload.run(faults.sessions_for(name, sessions), turns))
    await asyncio.sleep(faults.rng.uniform(0.05, 0.6))  # while requests run
    try:
        row.at_moment += await faults.inject(name, workload)
        victim = faults._victim
        row.injected += 1
        if faults.hold_s(name) or name == "stop_heartbeats":
            await asyncio.sleep(faults.hold_s(name) or HEARTBEATS_OFF_S)
            await faults.clear(name)
            await run
        else:
            await run
            await faults.clear(name)
    finally:
        if not run.done():  # the fault raised: the workload still ends, bounded
            await run
    clock("inject_run_clear")
    skipped = faults.files.skipped
    row.problems_after += await faults.after(name, victim, workload, sessions, turns)
    row.checks_skipped += faults.files.skipped - skipped
    clock("after")
    outcomes = workload.outcomes[before:]
    row.requests += len(outcomes)
    for outcome in outcomes:
        row.outcomes[outcome.kind] += 1
        row.http_5xx += outcome.status >= 500
        row.latencies.append(outcome.latency_s)
        if outcome.kind != CORRECT:
            row.errors[f"{outcome.kind} {outcome.status} {outcome.reason[:160]}"] += 1
    row.leaked_pages += await settled_counts(cluster, baseline, timeout_s=45)
    clock("settle")
    good = await workload.run(1, 1)
    row.not_serving += good[0].kind != CORRECT
    clock("good")


class _Phases:
    """Adds the wall time since the last call to `totals[phase]`."""

    def __init__(self, totals: Counter) -> None:
        self.totals, self.last = totals, time.monotonic()

    def __call__(self, phase: str) -> None:
        now = time.monotonic()
        self.totals[phase] += now - self.last
        self.last = now
