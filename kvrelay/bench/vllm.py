"""`kvrelay bench vllm`: real vLLM engines (CPU) with `KvrelayConnector`,
against vLLM's own `NixlConnector` (P/D) and LMCache (reuse), in one run.

(a) P/D handoff: per connector a prefill engine and a decode engine, one
pair running at a time (an idle pair's own polling must not slow the
other's); each prompt (1K to 16K tokens by default) goes to the prefill with
`max_tokens=1` and `{"do_remote_decode": true}`, then with the returned
`kv_transfer_params` to the decode. Per request: the decode's time to first
token (vLLM's own: arrival to first token, which includes the KV transfer)
and the transfer time (kvrelay: the connector's pull; NIXL: its
`vllm:nixl_xfer_time_seconds`); per pair, the CPU its two engines use while
idle.

(b) Reuse (`kvrelay.bench.vllm_reuse`): per connector (kvrelay's cache
server, LMCache's server), one engine computes every prompt cold, then a
fresh engine gets the same prompts: the share of prompt tokens it took from
the store and both TTFTs.

Every decode's and fresh engine's greedy tokens must equal the cold
engine's. The engines run in vLLM's environment (`make vllm-deps`, plus
`nixl-cu12` for NIXL: `make vllm-bench-deps`; LMCache's in its own, `make
lmcache-deps`), in processes of their own (`kvrelay.bench.vllm_engine`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

from kvrelay import options
from kvrelay.bench import vllm_reuse
from kvrelay.bench.stats import format_table, write_report
from kvrelay.bench.vllm_lmcache import LMCacheServerConfig
from kvrelay.bench.vllm_process import BLOCK, ROOT, Engine, longest_prompt, warm_up
from kvrelay.bench.vllm_reuse import REUSE_CONNECTORS, TOKEN, kvrelay_transfer
from kvrelay.ports import free_port

CONNECTORS = ("kvrelay", "nixl")
PARTS = ("pd", "reuse")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"),
                        help="the Python of vLLM's environment (make vllm-deps)")  # fmt: skip
    parser.add_argument("--model", help="model directory (default: a random Llama)")
    parser.add_argument("--layers", type=int, default=8, help="the random model's (no --model)")
    parser.add_argument("--hidden", type=int, default=256, help="the random model's")
    parser.add_argument("--heads", type=int, default=4, help="the random model's")
    parser.add_argument("--kv-heads", type=int, default=4, help="the random model's")
    parser.add_argument("--sizes", default="1024,2048,4096,8192,16384",
                        help="P/D prompt lengths in tokens, comma separated")  # fmt: skip
    parser.add_argument("--reuse-sizes", default="1024,1500,2048,4096,5000,8192,16384",
                        help="reuse prompt lengths in tokens (some not a multiple of "
                        "LMCache's 256-token chunk)")  # fmt: skip
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
    parser.add_argument("--parts", default=",".join(PARTS),
                        help="which parts to run, of " + ",".join(PARTS))  # fmt: skip
    parser.add_argument("--connectors", default=",".join(CONNECTORS),
                        help="P/D connectors to compare, of " + ",".join(CONNECTORS))  # fmt: skip
    parser.add_argument("--reuse-connectors", default=",".join(REUSE_CONNECTORS),
                        help="reuse connectors, of " + ",".join(REUSE_CONNECTORS))  # fmt: skip
    parser.add_argument("--engine-timeout-s", type=float, default=600.0)
    parser.add_argument("--out", help="logs directory (default: a temporary one)")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    options.add_arguments(parser, LMCacheServerConfig)


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
            for i, tokens in enumerate([warm_up(sizes), *asks]):
                held = prefill.ask(tokens, 1, {"do_remote_decode": True})
                params = dict(held["kv_transfer_params"] or {})
                params.pop("remote_prefill_cached_tokens", None)  # report the decode's own
                reply = decode.ask(tokens, args.decode_tokens, params)
                if i:
                    out[name].append(reply | {"size": len(tokens), "first": held["tokens"][:1]})
                else:
                    time.sleep(1.0)  # the handoff's release settles, then the pair idles
                    idle[name] = idle_cores([prefill.process.pid, decode.process.pid])
        except BaseException:  # an error or a signal's unwind: nothing more to wait for
            for engine in (prefill, decode):
                engine.stop()
            raise
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


def _names(text: str, known: tuple[str, ...], flag: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    if set(names) - set(known):
        raise SystemExit(f"kvrelay bench vllm: {flag} from {known}")
    return names


def run(args: argparse.Namespace) -> dict:
    from kvrelay.model import write_model
    from kvrelay.model.config import ModelConfig
    from kvrelay.model.loader import kv_spec
    from kvrelay.model.make_model import RandomModelSpec

    parts = _names(args.parts, PARTS, "--parts")
    names = _names(args.connectors, CONNECTORS, "--connectors") if "pd" in parts else []
    reuse_names = _names(args.reuse_connectors, REUSE_CONNECTORS, "--reuse-connectors")
    reuse_names = reuse_names if "reuse" in parts else []
    lmcache = options.from_args(LMCacheServerConfig, args)
    for field in dataclasses.fields(LMCacheServerConfig):  # the JSON's args: values, not "unset"
        setattr(args, field.name, getattr(lmcache, field.name))
    if not Path(args.vllm_python).exists():
        raise SystemExit(f"kvrelay bench vllm: no {args.vllm_python} (make vllm-bench-deps)")
    sizes = [int(s) for s in args.sizes.split(",") if s]
    reuse_sizes = [int(s) for s in args.reuse_sizes.split(",") if s]
    if not sizes or not reuse_sizes or min(sizes + reuse_sizes) < 2 or args.rounds < 1 \
            or args.decode_tokens < 1:  # fmt: skip
        raise SystemExit("kvrelay bench vllm: sizes >= 2 tokens, rounds and decode tokens >= 1")
    print(host_facts(), flush=True)
    work = Path(args.out or tempfile.mkdtemp(prefix="kvrelay-bench-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    random_model = RandomModelSpec(layers=args.layers, hidden=args.hidden, heads=args.heads,
                                   kv_heads=args.kv_heads, vocab=512, seed=11,
                                   max_positions=longest_prompt(args) + 1024)  # fmt: skip
    model_dir = Path(args.model or write_model(work / "llama", random_model))
    spec = kv_spec(model_dir, ModelConfig.from_dir(model_dir), args.dtype, BLOCK)
    asks = prompts(sizes, args.rounds) if names else []
    reuse = vllm_reuse.run_reuse(args, lmcache, reuse_names, model_dir, work, spec)
    pd, idle = run_pd(args, names, model_dir, work, asks, sizes)
    return report(args, names, sizes, asks, reuse, pd, idle)


def host_facts() -> str:
    """What the figures depend on besides the code: cores, CPU, memory, kernel,
    and the load when the bench started (others' work shares the cores)."""
    with open("/proc/meminfo") as meminfo:
        mem_gib = int(meminfo.readline().split()[1]) / (1 << 20)
    model = "?"
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"host: {os.cpu_count()} CPUs ({model}), {mem_gib:.0f} GiB, kernel "
            f"{platform.release()}, load average at start {load}")  # fmt: skip


REQUEST_FIELDS = ("size", "ttft_s", "transfer_s", "cached", "queued_to_scheduled_s",
                  "scheduled_to_first_token_s")  # fmt: skip


def compare_outputs(names, asks, reuse_outputs, pd) -> tuple[bool, list[dict]]:
    """Whether every generation of each prompt agrees: each reuse connector's
    cold and fresh engines', each decode's, each prefill's first token; and,
    for each prompt where they do not, every source's tokens."""
    outputs: dict[tuple, dict[str, list[int]]] = {}
    for source, pairs in reuse_outputs.items():
        for tokens, generated in pairs:
            outputs.setdefault(tuple(tokens), {})[source] = generated
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


def report(args, names, sizes, asks, reuse, pd, idle) -> dict:
    equal, differing = compare_outputs(names, asks, vllm_reuse.outputs(reuse), pd)
    reuse_summaries = {name: vllm_reuse.summary(run) for name, run in reuse.items()}
    result = {"outputs_equal": equal, "differing": differing,
              "pd": {name: pd_summary(pd[name], sizes) | {"idle_cores": idle.get(name)}
                     for name in names}}  # fmt: skip
    if "kvrelay" in reuse_summaries:
        result["reuse"] = reuse_summaries["kvrelay"]
    result["reuse_peers"] = {n: s for n, s in reuse_summaries.items() if n != "kvrelay"}
    if names:
        rows = []
        for name in names:
            summary = result["pd"][name]
            for n, size in [*summary["per_size"].items(), ("all", summary)]:
                rows.append([name, n, _ms(size["ttft_p50_s"]), _ms(size["transfer_p50_s"])])
        print("P/D handoff: decode-side TTFT and KV transfer, medians in ms")
        print(format_table(["connector", "prompt tokens", "TTFT", "transfer"], rows))
        for name in names:
            print(f"{name}: its idle pair keeps {result['pd'][name]['idle_cores']:.2f} cores busy")
    if reuse_summaries:
        print("\nReuse (a fresh engine after a cold one, through each connector's store)")
        print(format_table(vllm_reuse.TABLE_HEADER, vllm_reuse.table_rows(reuse_summaries)))
        for name, summary in reuse_summaries.items():
            if "absent" in summary:
                print(f"{name}: absent: {summary['absent']}")
    print(f"\noutputs equal: {equal}")
    for case in differing:
        print(f"  {case['prompt_tokens']}-token prompt:", json.dumps(case["outputs"]))
    write_report(args, "vllm", result)
    return result


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"
