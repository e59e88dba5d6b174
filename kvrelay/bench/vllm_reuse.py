"""`kvrelay bench vllm`'s reuse part: per connector, one engine computes every
prompt cold (its KV goes to the connector's store), then a fresh engine,
started beside it but asked only afterwards, gets the same prompts. Measured:
the share of prompt tokens the fresh engine did not compute (vLLM's
`num_cached_tokens`), both engines' TTFT, and whether the fresh engine's
greedy tokens equal the cold one's.

kvrelay: `KvrelayConnector` over a kvrelay cache server (its pages are
written through as the cold engine computes them). LMCache:
`LMCacheMPConnector` over an `lmcache server` (`kvrelay.bench.vllm_lmcache`),
in LMCache's own environment.
"""

from __future__ import annotations

import random
import statistics

from kvrelay.bench.vllm_lmcache import QUIET_ENV, LMCacheServer, LMCacheServerConfig, missing
from kvrelay.bench.vllm_process import BLOCK, Engine, warm_up

TOKEN = "bench-vllm"
REUSE_CONNECTORS = ("kvrelay", "lmcache")


def reuse_prompts(sizes: list[int]) -> list[list[int]]:
    rnd = random.Random(13)
    return [[rnd.randrange(512) for _ in range(n)] for n in sizes]


def kvrelay_transfer(role: str, extra: dict) -> dict:
    return {"kv_connector": "KvrelayConnector", "kv_role": role,
            "kv_connector_module_path": "kvrelay.adapters.vllm.connector",
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}  # fmt: skip


def _cold_then_fresh(engines: list[Engine], args, asks, sizes) -> tuple[list[dict], list[dict]]:
    """Both engines up, then the cold one answers every prompt, then the fresh
    one (after an uncounted warm-up each; the fresh one's hits the store)."""
    runs = []
    try:
        for engine in engines:
            engine.ready()
        for engine in engines:
            engine.ask(warm_up(sizes), args.decode_tokens)
            runs.append([engine.ask(t, args.decode_tokens) | {"size": len(t)} for t in asks])
    except BaseException:  # an error or a signal's unwind: nothing more to wait for
        for engine in engines:
            engine.stop()
        raise
    finally:
        for engine in engines:
            engine.close()
    return runs[0], runs[1]


def run_kvrelay(args, model_dir, work, asks, spec, sizes) -> tuple[list[dict], list[dict]]:
    from kvrelay.cache.launch import CacheServerProcess

    pages = sum(-(-len(t) // BLOCK) for t in [*asks, warm_up(sizes)]) + 16
    server = CacheServerProcess(token=TOKEN, page_bytes=spec.page_bytes, pages=pages,
                                backend=args.backend)  # fmt: skip
    try:
        extra = {"token": TOKEN, "backend": args.backend, "servers": [server.address],
                 "timeout_s": 60.0}  # fmt: skip
        engines = [Engine(f"kvrelay-reuse-{role}", args, model_dir, work,
                          kvrelay_transfer("kv_both", extra))
                   for role in ("cold", "fresh")]  # fmt: skip
        return _cold_then_fresh(engines, args, asks, sizes)
    finally:
        server.stop()


def run_lmcache(args, config: LMCacheServerConfig, model_dir, work, asks, spec,
                sizes) -> tuple[list[dict], list[dict], dict]:  # fmt: skip
    """The same flow through an LMCache server; also returns how it was run."""
    kv_bytes = sum(len(t) for t in [*asks, warm_up(sizes)]) * spec.page_bytes // BLOCK
    server = LMCacheServer(config, kv_bytes)
    try:
        engines = [Engine(f"lmcache-reuse-{role}", args, model_dir, work,
                          server.transfer_config(), QUIET_ENV, python=config.lmcache_python)
                   for role in ("cold", "fresh")]  # fmt: skip
        cold, fresh = _cold_then_fresh(engines, args, asks, sizes)
    finally:
        server.stop()
    setup = {"server_command": server.command[1:], "l1_size_gb": server.l1_size_gb,
             "python": config.lmcache_python}  # fmt: skip
    return cold, fresh, setup


def run_reuse(args, config: LMCacheServerConfig, names, model_dir, work, spec) -> dict:
    """{connector: {"cold", "fresh", "prompts"} or {"absent": why}}, one
    connector's engines (and server) at a time."""
    sizes = [int(s) for s in args.reuse_sizes.split(",") if s]
    asks = reuse_prompts(sizes)
    out: dict[str, dict] = {}
    for name in names:
        if name == "kvrelay":
            cold, fresh = run_kvrelay(args, model_dir, work, asks, spec, sizes)
            out[name] = {"cold": cold, "fresh": fresh, "prompts": asks}
        elif (why := missing(config)) is not None:
            out[name] = {"absent": why}
        else:
            cold, fresh, setup = run_lmcache(args, config, model_dir, work, asks, spec, sizes)
            out[name] = {"cold": cold, "fresh": fresh, "prompts": asks, "setup": setup}
    return out


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summary(run: dict) -> dict:
    """One connector's figures for the JSON (`absent` and why when it did not run)."""
    if "absent" in run:
        return {"absent": run["absent"]}
    cold, fresh = run["cold"], run["fresh"]
    differing = [c["size"] for c, w in zip(cold, fresh, strict=True) if c["tokens"] != w["tokens"]]
    return {
        "hit_fraction": sum(w["cached"] for w in fresh) / sum(w["size"] for w in fresh),
        "ttft_cold_p50_s": _median(c["ttft_s"] for c in cold),
        "ttft_hit_p50_s": _median(w["ttft_s"] for w in fresh),
        # the fresh engine's greedy tokens against the cold one's, prompt by prompt
        "outputs_equal": not differing,
        "differing_sizes": differing,
        "per_size": {
            str(c["size"]): {
                "ttft_cold_s": c["ttft_s"],
                "ttft_hit_s": w["ttft_s"],
                "cached": w["cached"],
                "hit_fraction": w["cached"] / w["size"],
            }
            for c, w in zip(cold, fresh, strict=True)
        },
    } | ({"setup": run["setup"]} if "setup" in run else {})


def outputs(runs: dict) -> dict[str, list[tuple[list[int], list[int]]]]:
    """Every engine's (prompt, generated tokens), by source, for the bench's
    comparison across connectors."""
    out = {}
    for name, run in runs.items():
        for role in ("cold", "fresh"):
            if role in run:
                out[f"{name}-reuse-{role}"] = [
                    (tokens, reply["tokens"])
                    for tokens, reply in zip(run["prompts"], run[role], strict=True)
                ]
    return out


def table_rows(summaries: dict) -> list[list[str]]:
    rows = []
    for name, s in summaries.items():
        if "absent" in s:
            rows.append([name, "absent", "-", "-", "-", "-"])
            continue
        for size, v in s["per_size"].items():
            rows.append([name, size, f"{v['hit_fraction']:.4f}", _ms(v["ttft_cold_s"]),
                         _ms(v["ttft_hit_s"]), ""])  # fmt: skip
        rows.append([name, "p50", f"{s['hit_fraction']:.4f}", _ms(s["ttft_cold_p50_s"]),
                     _ms(s["ttft_hit_p50_s"]), str(s["outputs_equal"])])  # fmt: skip
    return rows


TABLE_HEADER = ["connector", "prompt tokens", "hit fraction", "TTFT cold ms", "TTFT hit ms",
                "fresh = cold"]  # fmt: skip


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"
