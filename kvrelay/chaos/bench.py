"""`kvrelay bench chaos`: faults, hostile input and a bounded load run
against a real local cluster; one table row per fault and per hostile
family, the counters in JSON under fixed names (`injected`, `lost`, `hung`,
`leaked_pages`, `wrong_tokens`, `http_5xx`, `crashes`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from kvrelay.chaos import hostile, setup
from kvrelay.chaos.cluster import ChaosCluster, ChaosConfig
from kvrelay.chaos.faults import FaultRow, Faults, fault_round
from kvrelay.chaos.load import load_run
from kvrelay.chaos.workload import Oracle, Workload

PAGE, DTYPE = 16, "float64"
CHUNK = 500  # hostile cases of one family before the next family's turn


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--minutes",
        type=float,
        default=10.0,
        help="time budget of the faults and hostile input (the load run follows)",
    )
    parser.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="fault clusters running injections at once (each a full cluster)",
    )
    parser.add_argument("--injections", type=int, default=20, help="injections per fault")
    parser.add_argument("--hostile", type=int, default=10_000, help="cases per hostile family")
    parser.add_argument("--faults", default="", help="comma-separated subset of the faults")
    parser.add_argument("--sessions", type=int, default=2, help="sessions under each fault")
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--load-requests", type=int, default=1000)
    parser.add_argument("--load-sessions", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--logs", default=None, help="directory of the processes' logs")


def run(args: argparse.Namespace) -> None:
    results = asyncio.run(run_chaos(args))
    print_tables(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


def make_model(directory: Path) -> tuple[Path, int]:
    from kvrelay.model import RandomModelSpec, write_model
    from kvrelay.model.loader import model_kv_spec

    spec = RandomModelSpec(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, std=0.2,
                           seed=21)  # fmt: skip
    model_dir = write_model(directory / "llama", spec)
    return model_dir, model_kv_spec(model_dir, DTYPE, PAGE).page_bytes


def fault_config(model_dir: Path, log_dir: Path, page_bytes: int) -> ChaosConfig:
    return ChaosConfig(model_dir=model_dir, log_dir=log_dir, page_bytes=page_bytes,
                       page_size=PAGE, dtype=DTYPE, l3="valkey,file")  # fmt: skip


def hostile_config(model_dir: Path, log_dir: Path, page_bytes: int) -> ChaosConfig:
    return ChaosConfig(model_dir=model_dir, log_dir=log_dir, page_bytes=page_bytes,
                       page_size=PAGE, dtype=DTYPE, prefill_workers=1, decode_workers=1,
                       cache_servers=1, l3="file", pages=64)  # fmt: skip


async def run_chaos(args) -> dict:
    """Hostile input on a small cluster of its own and the faults on
    `--parallel` full clusters, all at once until the time budget; then the
    load run on the first fault cluster."""
    work = Path(args.logs or tempfile.mkdtemp(prefix="kvrelay-chaos-"))
    model_dir, page_bytes = make_model(work)
    end = time.monotonic() + 60 * args.minutes
    configs = [fault_config(model_dir, work / f"logs-faults{k}", page_bytes)
               for k in range(args.parallel)]  # fmt: skip
    if args.hostile:
        configs.append(hostile_config(model_dir, work / "logs-hostile", page_bytes))
    clusters = [ChaosCluster(c) for c in configs]
    try:
        await asyncio.gather(*(asyncio.to_thread(c.start) for c in clusters))
        oracle = await asyncio.to_thread(Oracle, model_dir, DTYPE, PAGE)
        fault_clusters = clusters[: args.parallel]
        hostile_rows, jobs = [], []
        if args.hostile:
            jobs.append(shown(hostile_families(clusters[-1], args.hostile, args.seed, end,
                                               hostile_rows), "hostile input"))  # fmt: skip
        rows = fault_rows(fault_clusters[0], args)
        queue = fault_queue(rows, args, random.Random(args.seed))
        for k, cluster in enumerate(fault_clusters):
            workload = Workload(cluster.control_url, oracle, seed=args.seed + k)
            rng = random.Random(f"{args.seed}:{k}")
            jobs.append(fault_worker(cluster, workload, rng, queue, rows, args, end))
        await asyncio.gather(*jobs)
        workload = Workload(fault_clusters[0].control_url, oracle, seed=args.seed)
        for process in fault_clusters[0].workers():  # replacements still starting
            await asyncio.to_thread(process.wait_ready, fault_clusters[0].config.ready_timeout_s)
        load = await load_run(fault_clusters[0], workload, args.load_requests, args.load_sessions)
        crashes = sum(sum(c.unhandled_errors().values()) for c in clusters)
    finally:
        await asyncio.gather(*(asyncio.to_thread(c.stop) for c in clusters))
    return {"logs": str(work), "load_average": os.getloadavg(),
            "faults": [row.as_dict() for row in rows.values()], "hostile": hostile_rows,
            "load": load, "unhandled_errors_in_logs": crashes}  # fmt: skip


async def hostile_families(cluster: ChaosCluster, count: int, seed: int, end: float,
                           rows: list[dict]) -> None:  # fmt: skip
    """Every family against every listening server (the servers at once)."""
    token, pb = cluster.config.token, cluster.config.page_bytes
    cache_address = cluster.cache_addresses[0]
    arena = int(cluster.config.cache_gb / cluster.config.cache_servers * (1 << 30))
    cache, agent = await setup.cache_targets(cache_address, token, pb, arena)
    _, fields = await setup.reserved_handle(cache_address, token, pb, b"\x42" * 32, 300)
    prefill, decode = await setup.worker_targets(
        cluster.named("prefill")[0].ready["address"], cluster.named("decode")[0].ready["address"],
        token, 256, PAGE, fields["raw"])  # fmt: skip
    processes = {"cache": "cache0", "agent": "cache0", "prefill": cluster.named("prefill")[0].name,
                 "decode": cluster.named("decode")[0].name}  # fmt: skip

    async def families(target) -> None:
        """The families in turn, `CHUNK` cases at a time, so that a time
        budget too short for `count` of each still tries every family."""
        process = cluster.find(processes[target.name])
        alive = lambda p=process: p.popen.poll() is None  # noqa: E731
        totals = {f: hostile.FamilyResult(f, target.name) for f in hostile.FAMILIES}
        for chunk in range(-(-count // CHUNK)):
            for family, total in totals.items():
                n = min(CHUNK, count - chunk * CHUNK)
                if time.monotonic() > end or n <= 0:
                    continue
                before = cluster.unhandled_errors().get(process.name, 0)
                result = await hostile.run_family(target, family, n, seed=seed * 100_000 + chunk,
                                                  alive=alive, deadline=end)  # fmt: skip
                result.crashes += cluster.unhandled_errors().get(process.name, 0) - before
                total.add(result)
        for total in totals.values():
            if total.tried:
                rows.append(total.as_dict())
                progress(rows[-1])

    await asyncio.gather(*(families(t) for t in (cache, agent, prefill, decode)))


async def shown(job, what: str) -> None:
    """Runs `job`; a failure of the harness itself is printed, not fatal to the other jobs."""
    try:
        await job
    except Exception as exc:
        print(f"{what}: the harness failed: {exc!r}", file=sys.stderr, flush=True)


def fault_rows(cluster: ChaosCluster, args) -> dict[str, FaultRow]:
    names = [n for n in args.faults.split(",") if n] or Faults(cluster, random.Random()).names()
    return {name: FaultRow(name) for name in names}


def fault_queue(rows: dict, args, rng: random.Random) -> list[str]:
    """Injection 1 of every fault (in a random order), then injection 2, ..."""
    queue = []
    for _ in range(args.injections):
        queue += rng.sample(list(rows), len(rows))
    return queue


async def next_fault(queue: list[str], faults: Faults, wait_s: float = 60.0) -> str | None:
    """Takes the first fault in `queue` this cluster can take now (e.g. not
    a prefill kill while a killed prefill's replacement still starts), so a
    cluster runs other injections instead of waiting; after `wait_s` with
    none ready, the first in the queue (its round waits for the cluster);
    None once another cluster took the last."""
    deadline = time.monotonic() + wait_s
    while queue:
        ready = next((n for n in queue if faults.is_ready(n)), None)
        if ready is not None or time.monotonic() > deadline:
            name = ready if ready is not None else queue[0]
            queue.remove(name)  # the first of its name: the queue stays in round order
            return name
        await asyncio.sleep(0.2)
    return None


async def fault_worker(cluster, workload, rng, queue: list[str], rows: dict, args,
                       end: float) -> None:  # fmt: skip
    """One fault cluster: takes the next injection until none is left or time is up."""
    faults = Faults(cluster, rng, background_restarts=True)
    try:
        while queue and time.monotonic() < end:
            name = await next_fault(queue, faults)
            if name is None:
                break
            try:
                await fault_round(cluster, faults, workload, name, rows[name],
                                  sessions=args.sessions, turns=args.turns)  # fmt: skip
            except Exception as exc:  # the harness's own failure: counted, shown, go on
                rows[name].harness_errors += 1
                print(f"{name}: the round itself failed: {exc!r}", file=sys.stderr, flush=True)
            progress(rows[name].as_dict())
    finally:
        await faults.close()


def progress(row: dict) -> None:
    print(json.dumps(row), file=sys.stderr, flush=True)


def print_tables(results: dict) -> None:
    """Markdown tables (with a total row each), as docs/benchmarks.md shows them."""
    print(f"load average {results['load_average']}  (a shared machine: figures are noisy)")
    head = ("fault", "injected", "at_moment", "requests", "completed_correct",
            "failed_clear_error", "lost", "hung", "wrong_tokens", "http_5xx", "leaked_pages",
            "problems_after", "checks_skipped", "not_serving_after", "harness_errors",
            "p99_latency_s")  # fmt: skip
    table(head, results["faults"], "fault")
    print()
    table(("target", "family", "tried", "rejected", "crashes"), results["hostile"], "target")
    print()
    print("load:", json.dumps(results["load"]))
    print("unhandled errors in logs:", results["unhandled_errors_in_logs"])


def table(head: tuple, rows: list[dict], label: str) -> None:
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    total = dict.fromkeys(head, "")
    for row in rows:
        print("| " + " | ".join(str(row.get(k, "")) for k in head) + " |")
        for k in head:
            if isinstance(row.get(k), int) and not isinstance(row.get(k), bool):
                total[k] = (total[k] or 0) + row[k]
    total[label] = "total"
    print("| " + " | ".join(str(total[k]) for k in head) + " |")
