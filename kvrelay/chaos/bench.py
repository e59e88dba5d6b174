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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=10.0, help="time budget (faults stop)")
    parser.add_argument("--injections", type=int, default=20, help="injections per fault")
    parser.add_argument("--hostile", type=int, default=10_000, help="cases per hostile family")
    parser.add_argument("--faults", default="", help="comma-separated subset of the faults")
    parser.add_argument("--sessions", type=int, default=4, help="sessions under each fault")
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
    from kvrelay.model.config import ModelConfig
    from kvrelay.model.loader import kv_spec

    spec = RandomModelSpec(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, std=0.2,
                           seed=21)  # fmt: skip
    model_dir = write_model(directory / "llama", spec)
    return model_dir, kv_spec(model_dir, ModelConfig.from_dir(model_dir), DTYPE, PAGE).page_bytes


async def run_chaos(args) -> dict:
    work = Path(args.logs or tempfile.mkdtemp(prefix="kvrelay-chaos-"))
    model_dir, page_bytes = make_model(work)
    config = ChaosConfig(model_dir=model_dir, log_dir=work / "logs", page_bytes=page_bytes,
                         page_size=PAGE, dtype=DTYPE)  # fmt: skip
    end = time.monotonic() + 60 * args.minutes
    rng = random.Random(args.seed)
    cluster = await asyncio.to_thread(lambda: ChaosCluster(config).start())
    try:
        oracle = await asyncio.to_thread(Oracle, model_dir, DTYPE, PAGE)
        workload = Workload(cluster.control_url, oracle, seed=args.seed)
        hostile_rows = await hostile_families(cluster, args.hostile, args.seed)
        fault_rows = await fault_rounds(cluster, workload, rng, args, end)
        load = await load_run(cluster, workload, args.load_requests, args.load_sessions)
        crashes = sum(cluster.unhandled_errors().values())
    finally:
        await asyncio.to_thread(cluster.stop)
    return {"logs": str(work), "load_average": os.getloadavg(), "faults": fault_rows,
            "hostile": hostile_rows, "load": load, "unhandled_errors_in_logs": crashes}  # fmt: skip


async def hostile_families(cluster: ChaosCluster, count: int, seed: int) -> list[dict]:
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
    rows = []
    for target in (cache, agent, prefill, decode):
        process = cluster.find(processes[target.name])
        for family in hostile.FAMILIES:
            before = cluster.unhandled_errors().get(process.name, 0)
            alive = lambda p=process: p.popen.poll() is None  # noqa: E731
            result = await hostile.run_family(target, family, count, seed=seed, alive=alive)
            result.crashes += cluster.unhandled_errors().get(process.name, 0) - before
            if result.tried:
                rows.append(result.as_dict())
                progress(rows[-1])
    return rows


async def fault_rounds(cluster, workload, rng, args, end: float) -> list[dict]:
    faults = Faults(cluster, rng)
    names = [n for n in args.faults.split(",") if n] or faults.names()
    rows = {name: FaultRow(name) for name in names}
    for _ in range(args.injections):
        for name in rng.sample(names, len(names)):
            if time.monotonic() > end:
                break
            await fault_round(cluster, faults, workload, name, rows[name],
                              sessions=args.sessions, turns=args.turns)  # fmt: skip
            progress(rows[name].as_dict())
    return [row.as_dict() for row in rows.values()]


def progress(row: dict) -> None:
    print(json.dumps(row), file=sys.stderr, flush=True)


def print_tables(results: dict) -> None:
    print(f"load average {results['load_average']}  (a shared machine: figures are noisy)")
    head = ("fault", "injected", "requests", "completed_correct", "failed_clear_error", "lost",
            "hung", "wrong_tokens", "http_5xx", "leaked_pages", "p99_latency_s")  # fmt: skip
    print(" | ".join(head))
    for row in results["faults"]:
        print(" | ".join(str(row[k]) for k in head))
    print()
    head = ("target", "family", "tried", "rejected", "crashes")
    print(" | ".join(head))
    for row in results["hostile"]:
        print(" | ".join(str(row[k]) for k in head))
    print()
    print("load:", json.dumps(results["load"]))
    print("unhandled errors in logs:", results["unhandled_errors_in_logs"])
