"""`kvrelay bench sglang-server`: real SGLang servers on an agentic workload,
with kvrelay as their L3, with SGLang's own `file` L3, and with none, in one run.

The workload is `kvrelay demo`'s (`kvrelay.demo.workload`): sessions sharing
a system prompt whose contexts grow by a tool output and an answer a turn,
replayed turn by turn, each session's turn after the others'. The SGLang
server (CPU engine through `kvrelay.adapters.sglang.cpu`, HiCache with the
`direct` io backend) gets device and host pools below the workload's working
set, and before every returning request (`--flush request`; `turn`: before
every turn) the server's device and host caches are emptied
(`/flush_cache`; the L3 keeps its pages), as when other sessions' traffic
has evicted a session's context: every returning request's context comes
from the L3 or is computed, so the L3 decides both the hit rate and the time
to first token. `--restart-every N` restarts the servers
every N turns instead, as a redeploy does (the same empty pools, at the cost
of a server start per mode). Before each request the machine idles
`--gap-s`, so that no mode's background L3 writes are timed in another
mode's request.

Per mode: hit rate (prompt tokens not computed / prompt tokens), the share
served from the L3 (`cached_tokens_details.storage`), TTFT p50, quartiles
and p99 (first streamed token); the workload's optimum (`optimum_hit_tokens`:
every page ever seen kept) and whether every mode generated the same tokens
(greedy). Each request goes to every mode back to back, so kvrelay and the
`file` L3 are also compared request by request (`kvrelay_over_file`: the
median and quartiles of the TTFT ratio, and in how many requests kvrelay was
faster), which a neighbour's load moves far less than two p50s.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvrelay.bench.stats import format_table, write_report
from kvrelay.demo.workload import Session, WorkloadConfig, optimum_hit_tokens

MODES = ("kvrelay", "file", "none")
TOKEN = "bench-sglang-server"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory (default: a random Llama)")
    parser.add_argument("--layers", type=int, default=8, help="the random model's (no --model)")
    parser.add_argument("--hidden", type=int, default=1024, help="the random model's")
    parser.add_argument("--heads", type=int, default=8, help="the random model's")
    parser.add_argument("--kv-heads", type=int, default=2, help="the random model's")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=2048)
    parser.add_argument("--user-tokens", type=int, default=128)
    # A returning turn appends far less than it resends, as an agent's does
    # (contexts of tens of thousands of tokens, a tool output of hundreds).
    parser.add_argument("--tool-tokens", type=int, default=256)
    parser.add_argument("--answer-tokens", type=int, default=8)
    parser.add_argument("--page-size", type=int, default=16)
    # float32 by default: a CPU without AVX-512 BF16 or AMX runs bfloat16
    # matmuls in software, 3x slower than float32 here, which no serving
    # hardware is; the compute would then bury the L3's share of TTFT.
    parser.add_argument("--dtype", default="float32",
                        choices=["float32", "bfloat16", "float16"])  # fmt: skip
    parser.add_argument("--device-tokens", type=int, default=4096,
                        help="SGLang's device KV pool (--max-total-tokens)")  # fmt: skip
    parser.add_argument("--host-ratio", type=float, default=1.5,
                        help="SGLang's host pool, x the device pool (--hicache-ratio)")  # fmt: skip
    parser.add_argument("--layout", default="layer_first",
                        choices=["layer_first", "page_first_direct"])  # fmt: skip
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per SGLang server (OMP_NUM_THREADS)")  # fmt: skip
    parser.add_argument("--flush", default="request", choices=["request", "turn", "never"],
                        help="empty the servers' device and host caches (the L3 kept) "
                        "before every request, every turn, or never")  # fmt: skip
    parser.add_argument("--restart-every", type=int, default=0, metavar="N",
                        help="restart the servers every N turns, as a redeploy does "
                        "(0: never)")  # fmt: skip
    parser.add_argument("--settle-s", type=float, default=3.0,
                        help="before a flush or restart: time for the L3 writes "
                        "to land")  # fmt: skip
    parser.add_argument("--gap-s", type=float, default=0.5,
                        help="idle time before each request, for the previous one's L3 "
                        "writes (no mode's background work is timed in another "
                        "mode's request)")  # fmt: skip
    parser.add_argument(
        "--modes", default=",".join(MODES), help="comma separated, of " + ",".join(MODES)
    )
    parser.add_argument("--out", help="logs directory (default: a temporary one)")
    parser.add_argument("--json", metavar="PATH", help="write the results here")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class _Mode:
    """One mode's servers: the SGLang server and what its L3 needs."""

    def __init__(self, mode: str, args, model_dir: Path, spec, work: Path) -> None:
        from kvrelay.adapters.sglang.cpu.server import SGLangServer, kvrelay_extra

        self.mode, self.cache = mode, None
        extra, file_dir = {}, None
        if mode == "kvrelay":
            from kvrelay.cache.launch import CacheServerProcess

            self.cache = CacheServerProcess(token=TOKEN, page_bytes=spec.page_bytes, pages=8192)
            extra = kvrelay_extra([self.cache.address], TOKEN, model_id=spec.model_id,
                                  weights_fingerprint=spec.weights_fingerprint)  # fmt: skip
        elif mode == "file":
            file_dir = work / "hicache-file"
            shutil.rmtree(file_dir, ignore_errors=True)
            file_dir.mkdir(parents=True)
        self.server = SGLangServer(
            model_dir, work / f"sglang-{mode}.log", l3=mode, extra=extra, file_dir=file_dir,
            layout=args.layout, page_size=args.page_size, dtype=args.dtype,
            device_tokens=args.device_tokens, host_ratio=args.host_ratio, sleep_on_idle=True,
            threads=args.threads,
        )  # fmt: skip

    def close(self) -> None:
        self.server.stop()
        if self.cache is not None:
            self.cache.stop()


def _summary(requests: list, seconds: float) -> dict:
    prompt_tokens = sum(r.prompt_tokens for _, r in requests)
    ttfts = [r.ttft_s for _, r in requests]
    return {
        "hit_rate": sum(r.cached_tokens for _, r in requests) / prompt_tokens,
        "storage_hit_rate": sum(r.storage_tokens for _, r in requests) / prompt_tokens,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p25_s": _percentile(ttfts, 0.25),
        "ttft_p75_s": _percentile(ttfts, 0.75),
        "ttft_p99_s": _percentile(ttfts, 0.99),
        "ttfts_s": ttfts,
        "prompt_tokens": prompt_tokens,
        "requests": len(requests),
        "serving_s": seconds,
    }


def paired(results: dict, mode: str, other: str) -> dict | None:
    """Request by request (the same prompt, sent back to back), `mode`'s TTFT
    over `other`'s: the median ratio, its quartiles, and how many requests
    `mode` served first; None unless both modes ran."""
    if mode not in results or other not in results:
        return None
    ratios = [a / b for a, b in zip(results[mode]["ttfts_s"], results[other]["ttfts_s"],
                                     strict=True)]  # fmt: skip
    return {
        "median_ratio": statistics.median(ratios),
        "p25_ratio": _percentile(ratios, 0.25),
        "p75_ratio": _percentile(ratios, 0.75),
        "faster": sum(r < 1 for r in ratios),
        "requests": len(ratios),
    }


def request_order(modes: list[str], j: int) -> list[str]:
    """The order in which request `j` goes to the modes: the first mode rotates,
    and every other round of rotations runs backwards, so that each mode takes
    each place and follows each other mode equally often (a mode always
    following the same one would always meet what that one leaves behind)."""
    n = len(modes)
    order = modes[j % n :] + modes[: j % n]
    return order[::-1] if (j // n) % 2 else order


def replay(modes: list[str], args, model_dir: Path, spec, work: Path) -> dict:
    """Every mode's server up at once, each request sent to each mode in turn
    (one request in flight on the machine, in `request_order`), so that
    the modes see the same load: on a shared 2-core host, modes run one after
    the other met different neighbours."""
    config = WorkloadConfig(
        sessions=args.sessions, turns=args.turns, system_tokens=args.system_tokens,
        user_tokens=args.user_tokens, tool_tokens=args.tool_tokens,
        answer_tokens=args.answer_tokens,
    )  # fmt: skip
    served = {}
    sessions = {m: [Session(i, config) for i in range(config.sessions)] for m in modes}
    requests = {m: [] for m in modes}
    seconds = dict.fromkeys(modes, 0.0)
    try:
        for mode in modes:
            served[mode] = _Mode(mode, args, model_dir, spec, work)
            served[mode].server.launch()
        for mode in modes:
            served[mode].server.wait_healthy()
        for turn in range(config.turns):
            restart = turn and args.restart_every and turn % args.restart_every == 0
            flush = turn and args.flush == "turn"
            if restart or flush:
                time.sleep(args.settle_s)
            if restart:
                for mode in modes:
                    served[mode].server.stop()
                    served[mode].server.launch()
                for mode in modes:
                    served[mode].server.wait_healthy()
            elif flush:
                for mode in modes:
                    served[mode].server.flush()
            for i in range(config.sessions):
                for mode in request_order(modes, turn * config.sessions + i):
                    session = sessions[mode][i]
                    prompt = session.prompt()
                    if turn and args.flush == "request":
                        served[mode].server.flush()
                    time.sleep(args.gap_s)
                    started = time.monotonic()
                    reply = served[mode].server.generate(prompt, config.answer_tokens)
                    seconds[mode] += time.monotonic() - started
                    requests[mode].append((prompt, reply))
                    session.answered(reply.output_ids)
    finally:
        for mode in served.values():
            mode.close()
    return {m: _summary(requests[m], seconds[m]) | {"_requests": requests[m]} for m in modes}


def run(args: argparse.Namespace) -> dict:
    from kvrelay.model import write_model
    from kvrelay.model.config import ModelConfig
    from kvrelay.model.loader import kv_spec
    from kvrelay.model.make_model import RandomModelSpec

    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        raise SystemExit(f"kvrelay bench sglang-server: --modes from {MODES}")
    if min(args.sessions, args.turns, args.system_tokens, args.answer_tokens, args.page_size) < 1:
        raise SystemExit("kvrelay bench sglang-server: sizes must be >= 1")
    work = Path(args.out or tempfile.mkdtemp(prefix="kvrelay-bench-sglang-"))
    work.mkdir(parents=True, exist_ok=True)
    # The default model costs enough compute per token (about 0.15 GFLOP)
    # that a returning turn's prefill is most of its time to first token, so
    # the prefill an L3 saves shows in TTFT (GQA: 2 KV heads of 128).
    random_model = RandomModelSpec(layers=args.layers, hidden=args.hidden, heads=args.heads,
                                   kv_heads=args.kv_heads, seed=9)  # fmt: skip
    model_dir = Path(args.model or write_model(work / "llama", random_model))
    spec = kv_spec(model_dir, ModelConfig.from_dir(model_dir), args.dtype, args.page_size,
                   key_scheme="sglang")  # fmt: skip
    results = replay(modes, args, model_dir, spec, work)
    first = next(iter(results.values()))["_requests"]
    pairs = [(prompt, reply.output_ids) for prompt, reply in first]
    optimum = sum(optimum_hit_tokens(pairs, args.page_size)) / sum(len(p) for p, _ in pairs)
    outputs = {m: [r.output_ids for _, r in res.pop("_requests")] for m, res in results.items()}
    outputs_equal = all(o == outputs[modes[0]] for o in outputs.values())
    table = [[m, f"{r['hit_rate']:.3f}", f"{r['storage_hit_rate']:.3f}",
              f"{r['ttft_p50_s'] * 1e3:.0f}",
              f"{r['ttft_p25_s'] * 1e3:.0f}-{r['ttft_p75_s'] * 1e3:.0f}",
              f"{r['ttft_p99_s'] * 1e3:.0f}", f"{r['serving_s']:.0f}"]
             for m, r in results.items()]  # fmt: skip
    pair = paired(results, "kvrelay", "file")
    print(f"{args.sessions} sessions x {args.turns} turns (system {args.system_tokens}, tool "
          f"{args.tool_tokens} tokens), device pool {args.device_tokens} tokens, host x"
          f"{args.host_ratio}, caches flushed every {args.flush}, servers restarted every "
          f"{args.restart_every or 'never'} turns; optimum hit rate "
          f"{optimum:.3f}, outputs equal across modes: {outputs_equal}")  # fmt: skip
    headers = ["L3", "hit rate", "from L3", "TTFT p50 ms", "p25-p75 ms", "TTFT p99 ms",
               "serving s"]  # fmt: skip
    print(format_table(headers, table))
    if pair is not None:
        print(f"kvrelay / file TTFT, request by request: median {pair['median_ratio']:.3f} "
              f"(quartiles {pair['p25_ratio']:.3f}-{pair['p75_ratio']:.3f}), kvrelay faster "
              f"in {pair['faster']} of {pair['requests']}")  # fmt: skip
    result = {"optimum": optimum, "outputs_equal": outputs_equal, "modes": results,
              "kvrelay_over_file": pair, "logs": str(work)}  # fmt: skip
    write_report(args, "sglang-server", result)
    sys.stdout.flush()
    return result
