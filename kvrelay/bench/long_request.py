"""`kvrelay bench long-request`: one very long request (1M tokens by default)
through a local cluster, end to end, against one process.

Computing a 1M-token context cold is about half an hour of CPU per copy
with the one-layer long demo model (and the reference needs a second), so by
default the context's KV is synthetic (finite page bytes drawn per page from a seeded generator) and
written to the cluster's cache tier under the context's page keys, as an
earlier turn's write-through would have left it. Then one completion of
context + `--new-tokens` tokens goes through control: prefill pulls the
context from the tier through its bounded window, computes only the new
tokens over it (chunked prefill, paged attention) and stages only the new
pages; decode takes the context from the tier and the new pages from
prefill, and generates. The reference is one process that imports the same
page bytes and generates the same prompt: the tokens must be equal. With
`--computed` the context is computed instead: a first request of the context
alone goes through the cluster cold (prefill computes it in chunks and
writes its pages through to the tier), the prefill pool is restarted (its
pool empty), and the request then takes the context from the tier; the
reference computes the whole prompt cold in one process. Pools
and staging are sized from the prompt (`pool_pages`); a pool too small for
it is refused with PoolExhausted (a 4xx/5xx with the reason), never an
out-of-memory. Printed: TTFT and total time, the workers' peak RSS (VmHWM,
every process of each worker's group), the reference's time, equality.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch

from kvrelay import procfs
from kvrelay.bench.stats import format_table, machine_info, write_json
from kvrelay.layout import DEFAULT_PAGE_SIZE

WINDOW = 256  # pages per write and per import of the synthetic context


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--context", type=int, default=(1 << 20) - 2048,
                        help="cached tokens (default: with --new-tokens 2048, a prompt of "
                        "2**20 tokens, control's most)")  # fmt: skip
    parser.add_argument("--new-tokens", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens generated")
    parser.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE)
    parser.add_argument("--max-prefill-tokens", type=int, default=8192)
    parser.add_argument("--num-pages", type=int, default=0,
                        help="pool pages per worker (0: what the prompt needs)")  # fmt: skip
    parser.add_argument("--backend", default="tcp", choices=["tcp", "ucx"])
    parser.add_argument("--out", default="bench-long-request", help="logs go here")
    parser.add_argument("--computed", action="store_true",
                        help="compute the context cold through the cluster (a first request "
                        "of the context alone, written through to the tier), restart the "
                        "prefill pool, then the request, which takes the context from the tier; "
                        "the reference computes the whole prompt in one process (about 30 "
                        "CPU-minutes each at 1M: docs/benchmarks.md)")  # fmt: skip
    parser.add_argument("--json", metavar="PATH")


def page_bytes_of(window: int, count: int, page_bytes: int) -> torch.Tensor:
    """The synthetic bytes of pages [window * WINDOW, + count): float32
    values of a seeded normal draw, scaled small (finite, attention-safe)."""
    gen = torch.Generator().manual_seed(1000 + window)
    values = torch.randn(count * page_bytes // 4, generator=gen) * 0.5
    return values.view(torch.uint8).view(count, page_bytes)


async def seed_tier(cluster, spec, keys: list[bytes], backend: str) -> None:
    """The context's pages into the tier, WINDOW at a time (write-through)."""
    from kvrelay.cache.client import CacheClient, CacheClientConfig
    from kvrelay.layout import ParallelConfig, rank_rectangle
    from kvrelay.transfer import create_agent

    pb = spec.page_bytes
    agent = await create_agent(backend, token=cluster.config.token)
    client = None
    try:
        config = CacheClientConfig(tuple(cluster.cache_addresses), cluster.config.token,
                                   timeout_s=30.0)  # fmt: skip
        client = CacheClient(agent, spec, rank_rectangle(spec, ParallelConfig()), config)
        arena = agent.allocate_arena(WINDOW * pb)
        rows = arena.tensor.view(WINDOW, pb)
        for window, first in enumerate(range(0, len(keys), WINDOW)):
            chunk = keys[first : first + WINDOW]
            rows[: len(chunk)].copy_(page_bytes_of(window, len(chunk), pb))
            written = await client.write(chunk, arena, [i * pb for i in range(len(chunk))])
            if written != len(chunk):
                raise RuntimeError(f"the tier took {written} of {len(chunk)} pages")
    finally:
        if client is not None:
            await client.close()
        await agent.close()


def reference(model_dir: Path, tokens: list[int], context_pages: int, args) -> tuple:
    """One process: the same page bytes imported (computed with `--computed`),
    the same prompt generated."""
    from kvrelay.model.engine import Request
    from kvrelay.model.loader import load_engine
    from kvrelay.model.page_export import import_prefix
    from kvrelay.model.sampling import SamplingParams

    ps = args.page_size
    pages = -(-(len(tokens) + args.max_tokens) // ps) + 2
    engine = load_engine(model_dir, num_pages=pages, dtype="float32", page_size=ps,
                         max_prefill_tokens=args.max_prefill_tokens)  # fmt: skip
    keys = engine.spec.page_keys(tokens)
    view = np.asarray(tokens)
    for window, first in enumerate(range(0, 0 if args.computed else context_pages, WINDOW)):
        count = min(WINDOW, context_pages - first)
        rows = page_bytes_of(window, count, engine.spec.page_bytes)
        import_prefix(engine, view[: (first + count) * ps], rows, list(range(count)),
                      chain=keys, first_page=first)  # fmt: skip
    start = time.perf_counter()
    result = engine.generate([Request(tokens, SamplingParams(args.max_tokens))])[0]
    return result.tokens, time.perf_counter() - start, result.cached_tokens


def group_peak_rss(pgid: int) -> int:
    """Sum of VmHWM over the processes of one process group (a worker's
    front and its ranks), bytes."""
    pids = [
        n for n in os.listdir("/proc") if n.isdigit() and procfs.stat_fields(n)[2:3] == [str(pgid)]
    ]
    return sum(procfs.status_kib(pid, "VmHWM") for pid in pids) * 1024


def send(url: str, tokens: list[int], max_tokens: int, timeout_s: float) -> dict:
    body = {"prompt": tokens, "max_tokens": max_tokens, "temperature": 0.0}
    start = time.perf_counter()
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=timeout_s)
    elapsed = time.perf_counter() - start
    if response.status_code != 200:
        raise SystemExit(f"HTTP {response.status_code}: {response.text[:500]}")
    answer = response.json()
    return answer | {"elapsed_s": elapsed}


def run(args: argparse.Namespace) -> None:
    ps = args.page_size
    if min(args.context, args.new_tokens, args.max_tokens) <= 0 or args.context % ps:
        raise SystemExit("--context (a multiple of --page-size), --new-tokens, --max-tokens > 0")
    info = machine_info() | {"load_average": list(os.getloadavg())}
    gen = np.random.default_rng(args.context)
    tokens = gen.integers(0, 256, args.context + args.new_tokens).tolist()
    result = _measure(args, tokens)
    _print_result(result)
    if args.json:
        write_json(args.json, {"machine": info, "args": vars(args) | {"func": None},
                               "result": result})  # fmt: skip
    if not result["tokens_equal"]:
        print("tokens differ from the one-process reference", file=sys.stderr)
        raise SystemExit(1)


def _measure(args: argparse.Namespace, tokens: list[int]) -> dict:
    """One long request through a fresh cluster whose tier holds its context,
    and the one-process reference's tokens."""
    from kvrelay.demo.cluster import ClusterConfig, LocalCluster, PoolConfig
    from kvrelay.demo.profiles import MODELS
    from kvrelay.model.loader import model_kv_spec
    from kvrelay.model.make_model import RandomModelSpec, write_model

    ps = args.page_size
    context_pages = args.context // ps
    pages = args.num_pages or -(-(len(tokens) + args.max_tokens) // ps) + 4
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(Path(tmp) / "model-long", RandomModelSpec(**MODELS["long"]))
        spec = model_kv_spec(model_dir, "float32", ps)
        tier_gb = 1.25 * (context_pages + 64) * spec.page_bytes / 1e9
        config = ClusterConfig(
            model_dir=model_dir, log_dir=Path(args.out) / "logs", cache="shared",
            prefill=PoolConfig(), decode=PoolConfig(), page_bytes=spec.page_bytes,
            page_size=ps, backend=args.backend, prefill_pages=pages, decode_pages=pages,
            cache_gb=tier_gb, max_prefill_tokens=args.max_prefill_tokens, slow_prefill_s=3600.0,
        )  # fmt: skip
        with LocalCluster(config) as cluster:
            started = time.perf_counter()
            cold = None
            if args.computed:
                cold = send(cluster.control_url, tokens[: args.context], 1, 7200.0)
                # A fresh prefill pool: the request's context can only come from the tier.
                cluster.redeploy("prefill", config.prefill)
            else:
                asyncio.run(seed_tier(cluster, spec, spec.page_keys(tokens)[:context_pages],
                                      args.backend))  # fmt: skip
            seeded_s = time.perf_counter() - started
            answer = send(cluster.control_url, tokens, args.max_tokens, 3600.0)
            peaks = {p.name: group_peak_rss(p.popen.pid) for p in cluster.processes}
        got = answer["choices"][0]["token_ids"]
        want, reference_s, cached = reference(model_dir, tokens, context_pages, args)
    kv = answer.get("kvrelay", {})
    return {
        "context": args.context, "new_tokens": args.new_tokens, "max_tokens": args.max_tokens,
        "tokens_equal": got == want, "tokens": got, "reference_tokens": want,
        "cached_tokens": kv.get("cached_tokens"), "ttft_s": kv.get("ttft_s"),
        "total_s": answer["elapsed_s"], "prefill_timings": kv.get("prefill_timings"),
        "decode_first_s": kv.get("decode_first_s"), "seed_tier_s": seeded_s,
        "reference_s": reference_s, "reference_cached": cached, "peak_rss_bytes": peaks,
        "pool_pages": pages, "page_bytes": spec.page_bytes, "computed": args.computed,
        "cold_s": None if cold is None else cold["elapsed_s"],
        "cold_cached_tokens": None if cold is None else cold.get("kvrelay", {}).get(
            "cached_tokens"),
    }  # fmt: skip


def _print_result(result: dict) -> None:
    row = [result["context"], result["new_tokens"], f"{result['ttft_s']:.2f}",
           f"{result['total_s']:.2f}", f"{result['reference_s']:.2f}",
           str(result["cached_tokens"]), "yes" if result["tokens_equal"] else "NO"]  # fmt: skip
    print(format_table(["context", "new", "TTFT s", "total s", "one process s", "cached",
                        "same tokens"], [row]))  # fmt: skip
    timings = result["prefill_timings"] or {}
    print("prefill phases (s): " + ", ".join(f"{k.removesuffix('_s')} {v:.2f}"
                                             for k, v in timings.items()))  # fmt: skip
    peaks = result["peak_rss_bytes"]
    print("peak RSS (MiB): " + ", ".join(f"{n} {b / 2**20:.0f}" for n, b in peaks.items()))
    if result["computed"]:
        print(
            f"context computed cold through the cluster in {result['cold_s']:.1f} s "
            f"(cached {result['cold_cached_tokens']}), then the prefill pool restarted"
        )
    else:
        print(f"context KV synthetic, seeded into the tier in {result['seed_tier_s']:.1f} s")
    print(f"pool pages per worker {result['pool_pages']} x {result['page_bytes']} B; "
          f"load average {os.getloadavg()}")  # fmt: skip
