"""`kvrelay demo`: the agentic multi-turn workload on a local cluster, per cache mode.

For each mode (shared tier, per-worker local caches only, no cache) it starts
a fresh cluster, replays the first turns of every session with the prefill
pool in one parallel config, redeploys the prefill pool in another config,
replays the remaining turns, and stops the cluster. Then it prints the table,
writes JSON and a PNG, and checks that every mode generated the same tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

from kvrelay.demo import phases, profiles
from kvrelay.demo.cluster import ClusterConfig, LocalCluster, PoolConfig
from kvrelay.demo.replay import TurnRecord, replay, replay_sample, sample_turns
from kvrelay.demo.report import MODE_LABELS, plot, summarize, table
from kvrelay.demo.workload import Session, WorkloadConfig, optimum_hit_tokens
from kvrelay.layout import DEFAULT_PAGE_SIZE

# `kvrelay.model.make_mla_model.MLA_ARCHS`, named here so `--help` needs no torch.
MLA_ARCHS = ("glm5", "deepseek_v32", "deepseek_v3")
MLA_SLOW_PREFILL_S = 900.0

DEMO_MODEL = profiles.MODELS["default"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    profiles.add_arguments(parser)
    parser.add_argument("--out", default="demo-out", help="logs, JSON and PNG go here")
    parser.add_argument(
        "--modes", default="shared,local,none", help="comma list of: shared, local, none"
    )
    parser.add_argument("--arch", default="llama", choices=["llama", *MLA_ARCHS],
                        help="demo model family: llama (GQA) or a GLM-5 / DeepSeek-shaped "
                        "model (MLA, DSA indexer, MoE) written to --model if absent")  # fmt: skip
    parser.add_argument("--dtype", choices=["float32", "float64", "bfloat16"], default=None,
                        help="model and KV dtype (default: float32; float64 for the MLA "
                        "family, whose DSA top-k flips at float32 near ties when a prompt is "
                        "cut differently, so modes would generate different tokens)")  # fmt: skip
    parser.add_argument("--speculative", type=int, default=0, metavar="K",
                        help="speculative mode: decode drafts K tokens per step with an MTP "
                        "layer (a demo model with --mtp 1; --model must have one)")  # fmt: skip
    parser.add_argument("--backend", default=_default_backend(), choices=["tcp", "ucx"],
                        help="transfer backend of every process (ucx when built)")  # fmt: skip
    parser.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="per request")
    parser.add_argument("--json", default=None, help="default: OUT/demo.json")
    parser.add_argument("--plot", default=None, help="default: OUT/demo.png")  # fmt: skip


def _default_backend() -> str:
    import importlib.util

    return "ucx" if importlib.util.find_spec("kvrelay._ucx") else "tcp"


def ensure_model(path: Path, mtp: int = 0, profile: str = "default", arch: str = "llama") -> Path:
    if not (path / "config.json").exists():
        print(f"writing a random {arch} demo model to {path}", flush=True)
        if arch in MLA_ARCHS:
            from kvrelay.model.make_mla_model import MlaModelSpec, write_mla_model

            shape = profiles.MLA_MODELS[profile]
            write_mla_model(path, MlaModelSpec(arch=arch, **shape, mtp=mtp))
        else:
            from kvrelay.model.make_model import RandomModelSpec, write_model

            write_model(path, RandomModelSpec(**profiles.MODELS[profile], mtp=mtp))
    return path


def page_bytes_of(model_dir: Path, dtype: str, page_size: int) -> int:
    from kvrelay.model.loader import model_kv_spec

    return model_kv_spec(model_dir, dtype, page_size).page_bytes


def optimum_by_turn(config: WorkloadConfig, records: list[TurnRecord], page_size: int) -> dict:
    """The infinite-cache optimum per (session, turn), requests taken turn by
    turn (every session's turn t before any turn t + 1)."""
    answers = {(r.session, r.turn): r.tokens for r in records if r.error is None}
    sessions = [Session(i, config) for i in range(config.sessions)]
    order, pairs = [], []
    for turn in range(config.turns):
        for session in sessions:
            answer = answers.get((session.index, turn))
            if answer is None:
                continue
            order.append((session.index, turn))
            pairs.append((session.prompt(), answer))
            session.answered(answer)
    return dict(zip(order, optimum_hit_tokens(pairs, page_size), strict=True))


def cluster_config(mode: str, args, workload: WorkloadConfig, model: Path,
                   page_bytes: int) -> ClusterConfig:  # fmt: skip
    def pages(given: int) -> int:
        if given:
            return given
        return profiles.pool_pages(args.pool_contexts, workload.final_context(),
                                   workload.answer_tokens, args.page_size)  # fmt: skip

    # Decode runs every session's sequence at once: its pool holds one
    # context per session on top of the profile's share.
    decode_contexts = args.pool_contexts + workload.sessions
    decode_pages = args.decode_pages or profiles.pool_pages(
        decode_contexts, workload.final_context(), workload.answer_tokens, args.page_size
    )
    return ClusterConfig(
        model_dir=model, log_dir=Path(args.out) / "logs" / mode, cache=mode,
        prefill=PoolConfig.parse(args.prefill), decode=PoolConfig.parse(args.decode),
        page_bytes=page_bytes, page_size=args.page_size, dtype=args.dtype, backend=args.backend,
        speculative=args.speculative, prefill_pages=pages(args.prefill_pages),
        decode_pages=decode_pages, cache_gb=args.cache_gb,
        max_prefill_tokens=args.max_prefill_tokens, slow_prefill_s=args.slow_prefill_s,
    )  # fmt: skip


def run_mode(mode: str, args, workload: WorkloadConfig, model: Path, page_bytes: int,
             reference: list[TurnRecord] | None = None):  # fmt: skip
    """The workload (or, with `reference`, its sampled turns) on a fresh cluster."""
    from tqdm import tqdm

    config = cluster_config(mode, args, workload, model, page_bytes)
    redeploy = PoolConfig.parse(args.redeploy) if args.redeploy else None
    split = workload.turns - args.redeploy_turns if redeploy else workload.turns
    picks = sample_turns(workload, args.sample) if reference is not None else None
    total = len(picks) if picks is not None else workload.sessions * workload.turns
    with LocalCluster(config) as cluster:
        url = cluster.control_url
        bar = tqdm(total=total, desc=f"{mode:>6} {config.prefill.label()}", unit="req",
                   file=sys.stdout)  # fmt: skip
        start = time.perf_counter()
        if picks is not None:
            sample = replay_sample(url, workload, reference, picks, timeout_s=args.timeout_s,
                                   progress=bar)  # fmt: skip
            records = asyncio.run(sample)
            redeploy = None
        else:
            records, sessions = asyncio.run(
                replay(url, workload, turns=range(split), timeout_s=args.timeout_s, progress=bar)
            )
        if redeploy:
            bar.set_description(f"{mode:>6} {redeploy.label()}")
            cluster.redeploy("prefill", redeploy)
            more, _ = asyncio.run(
                replay(url, workload, turns=range(split, workload.turns), sessions=sessions,
                       timeout_s=args.timeout_s, progress=bar)
            )  # fmt: skip
            records += more
        wall = time.perf_counter() - start
        bar.close()
        time.sleep(1.5)  # one more heartbeat: the workers' counters catch up
        stats = _control_stats(url)
    return records, split, wall, stats


def _control_stats(url: str) -> dict | None:
    import httpx

    try:
        return httpx.get(f"{url}/stats", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return None


def _print_speculation(stats: dict) -> None:
    """Draft tokens proposed/accepted per mode, from control's /stats counters."""
    for mode, data in stats.items():
        totals = (data or {}).get("worker_counters", {})
        proposed = totals.get("spec_proposed", 0)
        accepted, steps = totals.get("spec_accepted", 0), totals.get("spec_steps", 0)
        rate = accepted / proposed if proposed else 0.0
        length = (accepted + steps) / steps if steps else 0.0
        print(f"speculation ({mode}): {proposed} proposed, {accepted} accepted ({rate:.1%}), "
              f"mean accept length {length:.2f}")  # fmt: skip


def compare_tokens(runs: dict[str, list[TurnRecord]], sampled=()) -> list[str]:
    """Differences between modes' generated tokens, turn by turn, against the
    first mode (a sampled mode on its own turns only)."""
    if len(runs) < 2:
        return []
    names = list(runs)
    reference = {(r.session, r.turn): r.tokens for r in runs[names[0]] if r.error is None}
    problems = []
    for name in names[1:]:
        tokens = {(r.session, r.turn): r.tokens for r in runs[name] if r.error is None}
        keys = set(tokens) if name in sampled else set(tokens) | set(reference)
        for key in sorted(keys):
            if tokens.get(key) != reference.get(key):
                problems.append(f"{name} vs {names[0]}: session {key[0]} turn {key[1] + 1}")
    return problems


def run(args: argparse.Namespace) -> None:
    workload, modes, model = _prepare(args)
    page_bytes = page_bytes_of(model, args.dtype, args.page_size)
    print(f"workload ({args.profile}): {workload.sessions} sessions x {workload.turns} turns, "
          f"context {workload.system_tokens + workload.user_tokens} -> "
          f"{workload.final_context()} tokens; prefill {args.prefill} then "
          f"{args.redeploy or 'no redeploy'}, decode {args.decode}, {args.backend}",
          flush=True)  # fmt: skip
    runs, summaries, stats, sampled = {}, [], {}, set()
    optimum: dict = {}
    for mode in modes:
        # No cache recomputes every context: with --sample, a few of the
        # first full mode's prompts, spread over the turns, measure it.
        reference = runs[modes[0]] if mode == "none" and args.sample and runs else None
        records, split, wall, stats[mode] = run_mode(mode, args, workload, model, page_bytes,
                                                     reference)  # fmt: skip
        runs[mode] = records
        if reference is None:
            optimum = optimum or optimum_by_turn(workload, records, args.page_size)
        else:
            sampled.add(mode)
        summaries.append(summarize(mode, records, optimum, split, wall))
    if _report(args, workload, runs, summaries, stats, sampled):
        raise SystemExit(1)


def _prepare(args: argparse.Namespace) -> tuple[WorkloadConfig, list[str], Path]:
    """The workload, the modes and the model directory (made if missing) of `args`."""
    profiles.resolve(args)
    workload = WorkloadConfig(
        sessions=args.sessions, turns=args.turns, system_tokens=args.system_tokens,
        user_tokens=args.user_tokens, tool_tokens=args.tool_tokens,
        answer_tokens=args.answer_tokens, seed=args.seed,
    )  # fmt: skip
    if args.dtype is None:
        args.dtype = "float64" if args.arch in MLA_ARCHS else "float32"
    if args.arch in MLA_ARCHS and not args.slow_prefill_s:
        # The DSA indexer scores every earlier token: a cold prompt's prefill
        # is quadratic and takes minutes on a CPU (the no-cache mode).
        args.slow_prefill_s = MLA_SLOW_PREFILL_S
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - {"shared", "local", "none"}
    if unknown or not modes:
        raise SystemExit(f"kvrelay demo: unknown modes {sorted(unknown)}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.speculative < 0 or args.sample < 0:
        raise SystemExit("kvrelay demo: --speculative and --sample must be >= 0")
    if args.model == profiles.PROFILES[args.profile]["model"]:
        # Each family's demo model in a directory of its own; the plain demo
        # model has no MTP layer.
        args.model += "" if args.arch == "llama" else "-" + args.arch
        args.model += "-mtp" if args.speculative else ""
    model = ensure_model(Path(args.model), mtp=1 if args.speculative else 0,
                         profile=args.profile, arch=args.arch)  # fmt: skip
    return workload, modes, model


def _report(args, workload: WorkloadConfig, runs: dict, summaries: list, stats: dict,
            sampled: set[str]) -> bool:  # fmt: skip
    """Print the tables, write the JSON and the plot; True when a request
    failed or the modes' tokens differ."""
    out = Path(args.out)
    print()
    print(table(summaries))
    if sampled:
        print(f"(sampled: {', '.join(sorted(sampled))}: {args.sample} requests of the same "
              "prompts, one at a time)")  # fmt: skip
    breakdowns = {mode: phases.breakdown(records) for mode, records in runs.items()}
    print()
    print(phases.table(breakdowns, MODE_LABELS))
    problems = compare_tokens(runs, sampled)
    same = "identical" if not problems else f"DIFFERENT in {len(problems)} turns"
    print(f"\ngenerated tokens across modes ({', '.join(runs)}): {same}")
    for line in problems[:10]:
        print("  ", line)
    if args.speculative:
        _print_speculation(stats)
    json_path = Path(args.json or out / "demo.json")
    json_path.write_text(json.dumps({
        "workload": asdict(workload), "args": vars(args) | {"func": None},
        "load_average": list(os.getloadavg()), "sampled_modes": sorted(sampled),
        "summaries": [asdict(s) for s in summaries], "ttft_phases_s": breakdowns,
        "token_differences": problems,
        "records": {m: [asdict(r) for r in rs] for m, rs in runs.items()}, "control_stats": stats,
    }, indent=1, default=str))  # fmt: skip
    plot(Path(args.plot or out / "demo.png"), runs, summaries)
    print(f"load average {os.getloadavg()}")
    print(f"wrote {json_path} and {args.plot or out / 'demo.png'}; logs in {out / 'logs'}")
    return bool(sum(s.errors for s in summaries) or problems)
