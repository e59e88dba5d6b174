"""`kvrelay bench vllm`: real vLLM engines (CPU) with `KvrelayConnector`,
against vLLM's own `NixlConnector`, in one run.

(a) P/D handoff: per connector a prefill engine and a decode engine, one
pair running at a time (an idle pair's own polling must not slow the
other's); each prompt (1K to 16K tokens by default) goes to the prefill with
`max_tokens=1` and `{"do_remote_decode": true}`, then with the returned
`kv_transfer_params` to the decode. Per request: the decode's time to first
token (vLLM's own: arrival to first token, which includes the KV transfer)
and the transfer time (kvrelay: the connector's pull; NIXL: its
`vllm:nixl_xfer_time_seconds`); per pair, the CPU its two engines use while
idle.

(b) Reuse: a kvrelay cache server; one engine computes every prompt cold
(its pages go to the tier), then a fresh engine gets the same prompts: the
share of prompt tokens it took from the tier and both TTFTs.

Every decode's and the warm engine's greedy tokens must equal the cold
engine's. The engines run in vLLM's environment (`make vllm-deps`, plus
`nixl-cu12` for NIXL: `make vllm-bench-deps`), in processes of their own
(`kvrelay.bench.vllm_engine`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from kvrelay.bench.stats import format_table, write_report
from kvrelay.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "bench-vllm"
BLOCK = 128  # vLLM's CPU block size: one kvrelay page
CONNECTORS = ("kvrelay", "nixl")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"),
                        help="the Python of vLLM's environment (make vllm-deps)")  # fmt: skip
    parser.add_argument("--model", help="model directory (default: a random Llama)")
    parser.add_argument("--layers", type=int, default=8, help="the random model's (no --model)")
    parser.add_argument("--hidden", type=int, default=256, help="the random model's")
    parser.add_argument("--heads", type=int, default=4, help="the random model's")
    parser.add_argument("--kv-heads", type=int, default=4, help="the random model's")
    parser.add_argument("--sizes", default="1024,2048,4096,8192,16384",
                        help="prompt lengths in tokens, comma separated")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3, help="P/D requests per size")
    parser.add_argument("--decode-tokens", type=int, default=8)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the engines' model and KV dtype (float32: without AVX-512 BF16 "
                        "a CPU runs bfloat16 matmuls in software)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per engine (OMP_NUM_THREADS; 0: torch's "
                        "default, every core)")  # fmt: skip
    parser.add_argument("--backend", default="ucx", choices=["ucx", "tcp"],
                        help="kvrelay's transfer backend")  # fmt: skip
    parser.add_argument("--connectors", default=",".join(CONNECTORS),
                        help="P/D connectors to compare, of " + ",".join(CONNECTORS))  # fmt: skip
    parser.add_argument("--engine-timeout-s", type=float, default=600.0)
    parser.add_argument("--out", help="logs directory (default: a temporary one)")
    parser.add_argument("--json", metavar="PATH", help="write the results here")


class Engine:
    """One `vllm_engine` process: a request per stdin line, a reply per stdout line."""

    def __init__(self, name: str, args, model_dir: Path, work: Path, transfer, env=None) -> None:
        self.name, self.timeout_s = name, args.engine_timeout_s
        longest = max(int(s) for s in args.sizes.split(","))
        config = {"model": str(model_dir), "max_model_len": longest + args.decode_tokens + BLOCK,
                  "dtype": args.dtype, "kv_transfer_config": transfer}  # fmt: skip
        self.log = work / f"{name}.log"
        self._pending = b""
        # `--threads 1`: two engines share the host, and vLLM's processes spin
        # (`sched_yield`) for a second after each step, so an OpenMP team of
        # every core waits at each op for a thread a spinner displaced.
        threads = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
        full_env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
                        PYTHONPATH=str(ROOT), **threads, **(env or {}))  # fmt: skip
        with self.log.open("w") as err:
            self.process = subprocess.Popen(
                [args.vllm_python, "-m", "kvrelay.bench.vllm_engine", json.dumps(config)],
                cwd=ROOT, env=full_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=err, text=True,
            )  # fmt: skip

    def ready(self) -> Engine:
        """Waits for the engine to come up (engines start side by side)."""
        self._read()  # {"ready": true}
        return self

    def _read(self) -> dict:
        """The next JSON line on the engine's stdout (other lines are vLLM's).
        Read from the descriptor, not the buffered file: a line left in the
        file's buffer would never wake `select` again."""
        deadline = time.monotonic() + self.timeout_s
        fd = self.process.stdout.fileno()
        while time.monotonic() < deadline:
            while b"\n" in self._pending:
                line, self._pending = self._pending.split(b"\n", 1)
                if line.startswith(b"{"):
                    return json.loads(line)
            ready, _, _ = select.select([fd], [], [], 1.0)
            if ready:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                self._pending += chunk
            elif self.process.poll() is not None:
                break
        self.close()
        raise RuntimeError(f"engine {self.name} stopped: {self.log.read_text()[-3000:]}")

    def ask(self, tokens: list[int], max_tokens: int, params: dict | None = None) -> dict:
        ask = {"tokens": tokens, "max_tokens": max_tokens, "kv_transfer_params": params}
        self.process.stdin.write(json.dumps(ask) + "\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def kvrelay_transfer(role: str, extra: dict) -> dict:
    return {"kv_connector": "KvrelayConnector", "kv_role": role,
            "kv_connector_module_path": "kvrelay.adapters.vllm.connector",
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}  # fmt: skip


def nixl_transfer() -> dict:
    return {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {"backends": ["UCX"]}}  # fmt: skip


def pd_pair(name: str, args, model_dir: Path, work: Path) -> tuple[Engine, Engine]:
    if name == "nixl":
        # NIXL's own UCX: without InfiniBand modules excluded its processes
        # crash at exit on a host that has none.
        env = {"UCX_MODULES": "^ib"}
        pair = [Engine(f"nixl-{role}", args, model_dir, work, nixl_transfer(),
                       env | {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())})
                for role in ("prefill", "decode")]  # fmt: skip
        return pair[0], pair[1]
    extra = {"token": TOKEN, "backend": args.backend}
    producer = kvrelay_transfer("kv_producer", extra | {"handoff_port": free_port()})
    prefill = Engine("kvrelay-prefill", args, model_dir, work, producer)
    log = {"KVRELAY_VLLM_TRANSFER_LOG": str(work / "kvrelay-transfers.jsonl")}
    consumer = kvrelay_transfer("kv_consumer", extra)
    return prefill, Engine("kvrelay-decode", args, model_dir, work, consumer, log)


def prompts(sizes: list[int], rounds: int) -> list[list[int]]:
    rnd = random.Random(7)
    return [[rnd.randrange(512) for _ in range(n)] for _ in range(rounds) for n in sizes]


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def warm_up(args, sizes: list[int]) -> list[int]:
    """An uncounted prompt: an engine's first request pays one-time costs
    (first forward of each shape, a connector's first connection)."""
    rnd = random.Random(99)
    return [rnd.randrange(512) for _ in range(min(sizes))]


def run_pd(args, names, model_dir, work, asks, sizes) -> tuple[dict, dict]:
    """Each connector's pair alone (the other's engines are not running: an
    idle NIXL pair keeps both cores of a 2-core host busy polling, which would
    slow the other pair's copy and forward on a small host). Returns the
    replies and each pair's idle CPU (cores, measured between requests)."""
    out, idle = {}, {}
    for name in names:
        prefill, decode = pd_pair(name, args, model_dir, work)
        out[name] = []
        try:
            for engine in (prefill, decode):
                engine.ready()
            for i, tokens in enumerate([warm_up(args, sizes), *asks]):
                held = prefill.ask(tokens, 1, {"do_remote_decode": True})
                params = dict(held["kv_transfer_params"] or {})
                params.pop("remote_prefill_cached_tokens", None)  # report the decode's own
                reply = decode.ask(tokens, args.decode_tokens, params)
                if i:
                    out[name].append(reply | {"size": len(tokens), "first": held["tokens"][:1]})
                else:
                    time.sleep(1.0)  # the handoff's release settles, then the pair idles
                    idle[name] = idle_cores([prefill.process.pid, decode.process.pid])
        finally:
            for engine in (prefill, decode):
                engine.close()
    return out, idle


def _cpu_seconds(pids) -> float:
    """CPU time of the processes and all their descendants (Linux /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, list(pids)
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks
            with open(f"/proc/{pid}/task/{pid}/children") as children:
                todo.extend(int(c) for c in children.read().split())
        except (OSError, ValueError, IndexError):
            continue
    return total


def idle_cores(pids, seconds: float = 3.0) -> float:
    """Cores the idle processes (and their children) keep busy."""
    before = _cpu_seconds(pids)
    time.sleep(seconds)
    return (_cpu_seconds(pids) - before) / seconds


def run_reuse(args, model_dir, work, asks, spec, sizes) -> tuple[list[dict], list[dict]]:
    """A cold engine computes the prompts (writing through to the tier), then
    a second engine, started beside it but asked only afterwards, takes them."""
    from kvrelay.cache.launch import CacheServerProcess

    pages = sum(-(-len(t) // BLOCK) for t in [*asks, warm_up(args, sizes)]) + 16
    server = CacheServerProcess(token=TOKEN, page_bytes=spec.page_bytes, pages=pages,
                                backend=args.backend)  # fmt: skip
    extra = {"token": TOKEN, "backend": args.backend, "servers": [server.address],
             "timeout_s": 60.0}  # fmt: skip
    engines = [Engine(name, args, model_dir, work, kvrelay_transfer("kv_both", extra))
               for name in ("reuse-cold", "reuse-warm")]  # fmt: skip
    runs = []
    try:
        for engine in engines:
            engine.ready()
        for engine in engines:
            engine.ask(warm_up(args, sizes), args.decode_tokens)  # the warm one hits the tier
            runs.append([engine.ask(t, args.decode_tokens) | {"size": len(t)} for t in asks])
    finally:
        for engine in engines:
            engine.close()
        server.stop()
    return runs[0], runs[1]


def run(args: argparse.Namespace) -> dict:
    from kvrelay.model import write_model
    from kvrelay.model.config import ModelConfig
    from kvrelay.model.loader import kv_spec
    from kvrelay.model.make_model import RandomModelSpec

    names = [n for n in args.connectors.split(",") if n]
    if not names or set(names) - set(CONNECTORS):
        raise SystemExit(f"kvrelay bench vllm: --connectors from {CONNECTORS}")
    if not Path(args.vllm_python).exists():
        raise SystemExit(f"kvrelay bench vllm: no {args.vllm_python} (make vllm-bench-deps)")
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if not sizes or min(sizes) < 2 or args.rounds < 1 or args.decode_tokens < 1:
        raise SystemExit("kvrelay bench vllm: sizes >= 2 tokens, rounds and decode tokens >= 1")
    work = Path(args.out or tempfile.mkdtemp(prefix="kvrelay-bench-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    random_model = RandomModelSpec(layers=args.layers, hidden=args.hidden, heads=args.heads,
                                   kv_heads=args.kv_heads, vocab=512, seed=11,
                                   max_positions=max(sizes) + 1024)  # fmt: skip
    model_dir = Path(args.model or write_model(work / "llama", random_model))
    spec = kv_spec(model_dir, ModelConfig.from_dir(model_dir), args.dtype, BLOCK)
    asks = prompts(sizes, args.rounds)
    cold, warm = run_reuse(args, model_dir, work, asks[: len(sizes)], spec, sizes)
    pd, idle = run_pd(args, names, model_dir, work, asks, sizes)
    return report(args, names, sizes, asks, cold, warm, pd, idle)


REQUEST_FIELDS = ("size", "ttft_s", "transfer_s", "cached", "queued_to_scheduled_s",
                  "scheduled_to_first_token_s")  # fmt: skip


def compare_outputs(names, asks, cold, warm, pd) -> tuple[bool, list[dict]]:
    """Whether every generation of each prompt agrees: the cold engine's (first
    round's prompts), the warm one's, each decode's, each prefill's first
    token; and, for each prompt where they do not, every source's tokens."""
    outputs: dict[tuple, dict[str, list[int]]] = {}
    for source, replies in (("reuse-cold", cold), ("reuse-warm", warm)):
        for tokens, reply in zip(asks[: len(cold)], replies, strict=True):
            outputs.setdefault(tuple(tokens), {})[source] = reply["tokens"]
    for name in names:
        for tokens, reply in zip(asks, pd[name], strict=True):
            seen = outputs.setdefault(tuple(tokens), {})
            seen[f"{name}-decode"] = reply["tokens"]
            seen[f"{name}-prefill-first"] = reply["first"]
    differing = []
    for tokens, seen in outputs.items():
        # a prefill returns one token: it agrees when it is the others' first
        full = [o for source, o in seen.items() if not source.endswith("-first")]
        firsts = {o[0] for o in seen.values() if o}
        if any(o != full[0] for o in full) or len(firsts) > 1:
            differing.append({"prompt_tokens": len(tokens), "outputs": seen})
    return not differing, differing


def pd_summary(replies: list[dict], sizes: list[int]) -> dict:
    def p50(field: str, size: int | None = None):
        return median(r[field] for r in replies if size is None or r["size"] == size)

    return {
        "ttft_p50_s": p50("ttft_s"),
        "transfer_p50_s": p50("transfer_s"),
        "loaded_fraction": sum(r["cached"] for r in replies) / sum(r["size"] for r in replies),
        "requests": [{k: r[k] for k in REQUEST_FIELDS} for r in replies],
        "per_size": {
            str(n): {"ttft_p50_s": p50("ttft_s", n), "transfer_p50_s": p50("transfer_s", n)}
            for n in sizes
        },
    }


def reuse_summary(cold: list[dict], warm: list[dict]) -> dict:
    return {
        "hit_fraction": sum(w["cached"] for w in warm) / sum(w["size"] for w in warm),
        "ttft_cold_p50_s": median(c["ttft_s"] for c in cold),
        "ttft_hit_p50_s": median(w["ttft_s"] for w in warm),
        "per_size": {
            str(c["size"]): {
                "ttft_cold_s": c["ttft_s"],
                "ttft_hit_s": w["ttft_s"],
                "hit_fraction": w["cached"] / w["size"],
            }
            for c, w in zip(cold, warm, strict=True)
        },
    }


def report(args, names, sizes, asks, cold, warm, pd, idle) -> dict:
    equal, differing = compare_outputs(names, asks, cold, warm, pd)
    result = {"outputs_equal": equal, "differing": differing,
              "pd": {name: pd_summary(pd[name], sizes) | {"idle_cores": idle.get(name)}
                     for name in names},
              "reuse": reuse_summary(cold, warm)}  # fmt: skip
    rows = []
    for name in names:
        summary = result["pd"][name]
        for n, size in [*summary["per_size"].items(), ("all", summary)]:
            rows.append([name, n, _ms(size["ttft_p50_s"]), _ms(size["transfer_p50_s"])])
    reuse = result["reuse"]
    reuse_rows = [
        [s, f"{v['hit_fraction']:.3f}", _ms(v["ttft_cold_s"]), _ms(v["ttft_hit_s"])]
        for s, v in reuse["per_size"].items()
    ]
    print("P/D handoff: decode-side TTFT and KV transfer, medians in ms")
    print(format_table(["connector", "prompt tokens", "TTFT", "transfer"], rows))
    for name in names:
        print(f"{name}: its idle pair keeps {result['pd'][name]['idle_cores']:.2f} cores busy")
    print("\nReuse through the tier (a fresh engine after a cold one)")
    print(format_table(["prompt tokens", "hit fraction", "TTFT cold ms", "TTFT hit ms"],
                       reuse_rows))  # fmt: skip
    print(f"\noutputs equal: {equal}; reuse hit fraction {reuse['hit_fraction']:.3f}")
    for case in differing:
        print(f"  {case['prompt_tokens']}-token prompt:", json.dumps(case["outputs"]))
    write_report(args, "vllm", result)
    return result


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"
