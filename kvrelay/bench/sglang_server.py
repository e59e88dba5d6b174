"""`kvrelay bench sglang-server`: real SGLang servers on an agentic workload,
with kvrelay as their L3, with SGLang's own `mooncake` and `file` L3s, and
with none, in one run; optionally across a redeploy to servers of another
shape.

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
every N turns instead (the same empty pools, at the cost of a server start
per mode). Before each request the machine idles
`--gap-s`, so that no mode's background L3 writes are timed in another
mode's request.

Mooncake runs as SGLang's users set it up (`kvrelay.bench.sglang_mooncake`
starts the `mooncake_master` on loopback and writes the extra config):
`--hicache-storage-backend mooncake`, every rank contributing its share of
a global segment (`--mooncake-segment-gb`, SGLang's default 4), protocol
tcp, local_hostname 127.0.0.1, `MC_TCP_BIND_ADDRESS=127.0.0.1`, metadata by
`P2PHANDSHAKE` (SGLang's default; the master's HTTP metadata server listens
on every interface). SGLang's Mooncake backend stores an MHA page only from
a `page_first` or `page_first_direct` host pool, so its servers use
`page_first_direct` (direct io) whatever `--layout` says. Its segments live
in the SGLang processes and go when they stop. Mode `mooncake-holder`
keeps them in a process of its own (SGLang's README: a store service beside
servers with `global_segment_size` 0), so the store outlives the servers;
where a redeploy changes the TP size it also sets SGLang's `tp_lcm_size`
(the two sizes' least common multiple), which keys a page by head shards that
both sizes read and needs the `page_head` host layout (kernel io), which
that mode's servers then use (`--no-tp-lcm`: without it, where a TP=1 rank
reads TP=2 rank 0's objects, which hold half the heads, under the same key).

`--redeploy-turns N`: after `--turns` turns every server stops and the
sessions continue for N turns on servers of another shape (`--redeploy-tp`,
`--redeploy-layout`), each mode keeping its L3 (kvrelay's cache server, the
file directory, the Mooncake master and holder).

Per mode and phase: hit rate (prompt tokens not computed / prompt tokens),
its ratio to the optimum (every page ever seen kept), the phase's first
turn's hit rate (after a redeploy: what the store kept), the share served
from the L3 (`cached_tokens_details.storage`), TTFT p50, quartiles and p99
(first streamed token), and whether every mode generated the tokens of the
server without an L3 (greedy). Each request goes to every mode back to
back, so kvrelay and the `file` L3 are also compared request by request
(`kvrelay_over_file`: the median and quartiles of the TTFT ratio, and in
how many requests kvrelay was faster), which a neighbour's load moves far
less than two p50s.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvrelay.bench import sglang_server_report as report
from kvrelay.bench.stats import format_table, write_report
from kvrelay.demo.workload import Session, WorkloadConfig

MODES = ("kvrelay", "mooncake", "mooncake-holder", "file", "none")
DEFAULT_MODES = ("kvrelay", "mooncake", "file", "none")
TOKEN = "bench-sglang-server"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory (default: a random Llama)")
    parser.add_argument("--layers", type=int, default=8, help="the random model's (no --model)")
    parser.add_argument("--hidden", type=int, default=1024, help="the random model's")
    parser.add_argument("--heads", type=int, default=8, help="the random model's")
    parser.add_argument("--kv-heads", type=int, default=2, help="the random model's")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3, help="turns before any redeploy")
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
                        choices=["layer_first", "page_first_direct"],
                        help="host layout (Mooncake's servers: page_first_direct)")  # fmt: skip
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel ranks per server")
    parser.add_argument("--redeploy-turns", type=int, default=0, metavar="N",
                        help="after --turns, stop every server and continue N turns "
                        "on servers of --redeploy-tp / --redeploy-layout (0: none)")  # fmt: skip
    parser.add_argument("--redeploy-tp", type=int, help="default: --tp")
    parser.add_argument("--redeploy-layout", choices=["layer_first", "page_first_direct"],
                        help="default: --layout")  # fmt: skip
    parser.add_argument("--mooncake-segment-gb", type=float, default=4.0,
                        help="Mooncake's global_segment_size (the ranks' shares together, "
                        "or the holder's)")  # fmt: skip
    parser.add_argument("--no-tp-lcm", action="store_true",
                        help="mooncake-holder without SGLang's tp_lcm_size across a "
                        "TP change")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per SGLang rank (OMP_NUM_THREADS)")  # fmt: skip
    parser.add_argument("--flush", default="request", choices=["request", "turn", "never"],
                        help="empty the servers' device and host caches (the L3 kept) "
                        "before every request, every turn, or never")  # fmt: skip
    parser.add_argument("--restart-every", type=int, default=0, metavar="N",
                        help="restart the servers every N turns (0: never)")  # fmt: skip
    parser.add_argument("--settle-s", type=float, default=3.0,
                        help="before a flush or restart: time for the L3 writes "
                        "to land")  # fmt: skip
    parser.add_argument("--gap-s", type=float, default=0.5,
                        help="idle time before each request, for the previous one's L3 "
                        "writes (no mode's background work is timed in another "
                        "mode's request)")  # fmt: skip
    parser.add_argument("--modes", help=f"comma separated, of {','.join(MODES)} (default "
                        f"{','.join(DEFAULT_MODES)}, mooncake where it is installed)")  # fmt: skip
    parser.add_argument("--out", help="logs directory (default: a temporary one)")
    parser.add_argument("--json", metavar="PATH", help="write the results here")


class _Mode:
    """One mode's L3, kept for the whole run (across a redeploy too), and its
    current SGLang server."""

    def __init__(self, mode: str, args, model_dir: Path, spec, work: Path) -> None:
        self.mode, self.args, self.model_dir, self.work = mode, args, model_dir, work
        self.cache = self.master = self.holder = self.server = self.file_dir = None
        self.extra, self.layout = {}, None  # layout: the mode's own, whatever --layout says
        try:
            if mode == "kvrelay":
                self._kvrelay(spec)
            elif mode.startswith("mooncake"):
                self._mooncake(holder=mode == "mooncake-holder")
            elif mode == "file":
                self.file_dir = work / "hicache-file"
                shutil.rmtree(self.file_dir, ignore_errors=True)
                self.file_dir.mkdir(parents=True)
        except BaseException:
            self.close()
            raise

    def _kvrelay(self, spec) -> None:
        from kvrelay.adapters.sglang.cpu.server import kvrelay_extra
        from kvrelay.cache.launch import CacheServerProcess

        # Twice the pages the sessions' last contexts fill: capacity never decides a
        # hit, and the arena (resident from the start) leaves room for SGLang's
        # servers, which each keep 10 GiB of host memory free when they start.
        a = self.args
        grow = (a.turns + a.redeploy_turns - 1) * (a.tool_tokens + a.answer_tokens)
        final = a.system_tokens + a.user_tokens + grow
        pages = max(1024, 2 * a.sessions * -(-final // a.page_size))
        self.cache = CacheServerProcess(token=TOKEN, page_bytes=spec.page_bytes, pages=pages)
        self.extra = kvrelay_extra([self.cache.address], TOKEN, model_id=spec.model_id,
                                   weights_fingerprint=spec.weights_fingerprint)  # fmt: skip

    def _mooncake(self, holder: bool) -> None:
        from kvrelay.bench import sglang_mooncake as mooncake

        args = self.args
        segment = int(args.mooncake_segment_gb * (1 << 30))
        # Each rank mounts segment / tp (SGLang divides it), at least Mooncake's minimum.
        segment = max(segment, mooncake.MIN_SEGMENT_BYTES * max(args.tp, args.redeploy_tp))
        self.master = mooncake.MasterProcess()
        self.layout = "page_first_direct"
        if holder:
            self.holder = mooncake.SegmentHolder(self.master, segment)
            segment = 0  # the ranks mount none: every page goes to the holder
        self.extra = self.master.extra_config(segment)
        if holder and args.tp != args.redeploy_tp and not args.no_tp_lcm:
            self.extra["tp_lcm_size"] = math.lcm(args.tp, args.redeploy_tp)
            self.layout = "page_head"  # where SGLang splits a page's heads by tp_lcm_size

    def launch(self, tp: int, layout: str, tag: str) -> None:
        from kvrelay.adapters.sglang.cpu.server import SGLangServer

        a = self.args
        self.server = SGLangServer(
            self.model_dir, self.work / f"sglang-{self.mode}-{tag}.log",
            l3=self.mode.removesuffix("-holder"), extra=self.extra, file_dir=self.file_dir,
            layout=self.layout or layout, page_size=a.page_size, dtype=a.dtype,
            device_tokens=a.device_tokens, host_ratio=a.host_ratio, sleep_on_idle=True,
            threads=a.threads, tp=tp,
        ).launch()  # fmt: skip

    def held(self) -> int | None:
        """What the L3 holds now where it can be counted: the Mooncake
        master's keys (K and V of a page are two, and one warmup key per rank
        setup), the file L3's files."""
        if self.master is not None:
            return self.master.key_count()
        if self.file_dir is not None:
            return sum(1 for _ in self.file_dir.iterdir())
        return None

    def close(self) -> None:
        for part in (self.server, self.holder, self.master, self.cache):
            if part is not None:
                part.stop()


def request_order(modes: list[str], j: int) -> list[str]:
    """The order in which request `j` goes to the modes: the first mode rotates,
    and every other round of rotations runs backwards, so that each mode takes
    each place and follows each other mode equally often (a mode always
    following the same one would always meet what that one leaves behind)."""
    n = len(modes)
    order = modes[j % n :] + modes[: j % n]
    return order[::-1] if (j // n) % 2 else order


def _deploy(served: dict, tp: int, layout: str, tag: str) -> None:
    """Every mode's server of this shape up (they import and load side by side)."""
    for mode in served.values():
        mode.launch(tp, layout, tag)
    for mode in served.values():
        mode.server.wait_healthy()


def _stop_servers(served: dict) -> None:
    """All at once: a TP=2 server takes seconds to exit, mostly waiting."""
    with ThreadPoolExecutor(len(served)) as pool:
        list(pool.map(lambda mode: mode.server.stop(), served.values()))


def replay(modes: list[str], args, model_dir: Path, spec, work: Path) -> tuple[dict, dict]:
    """Every mode's server up at once, each request sent to each mode in turn
    (one request in flight on the machine, in `request_order`), so that
    the modes see the same load: on a shared 2-core host, modes run one after
    the other met different neighbours. Returns each mode's `Served`
    requests, and what each countable L3 held before and after the redeploy."""
    config = WorkloadConfig(
        sessions=args.sessions, turns=args.turns + args.redeploy_turns,
        system_tokens=args.system_tokens, user_tokens=args.user_tokens,
        tool_tokens=args.tool_tokens, answer_tokens=args.answer_tokens,
    )  # fmt: skip
    served, held = {}, {}
    sessions = {m: [Session(i, config) for i in range(config.sessions)] for m in modes}
    requests = {m: [] for m in modes}
    try:
        for mode in modes:
            served[mode] = _Mode(mode, args, model_dir, spec, work)
        _deploy(served, args.tp, args.layout, "a")
        for turn in range(config.turns):
            after = args.redeploy_turns and turn >= args.turns
            shape = (args.redeploy_tp, args.redeploy_layout) if after else (args.tp, args.layout)
            redeploy = after and turn == args.turns
            restart = turn and args.restart_every and turn % args.restart_every == 0
            flush = turn and args.flush == "turn"
            if redeploy or restart or flush:
                time.sleep(args.settle_s)
            if redeploy:
                held = {m: {"before": served[m].held()} for m in modes}
                _stop_servers(served)
                _deploy(served, *shape, "b")
                for m in modes:
                    held[m]["after"] = served[m].held()
            elif restart:
                _stop_servers(served)
                _deploy(served, *shape, f"t{turn}")
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
                    seconds = time.monotonic() - started
                    requests[mode].append(report.Served(turn, prompt, reply, seconds))
                    session.answered(reply.output_ids)
    finally:
        for mode in served.values():
            mode.close()
    return requests, {m: h for m, h in held.items() if h["before"] is not None}


def _modes(args) -> list[str]:
    from kvrelay.bench import sglang_mooncake

    why = sglang_mooncake.missing()
    if args.modes is None:
        if why is not None:
            print(f"mode mooncake left out: {why}")
        return [m for m in DEFAULT_MODES if why is None or not m.startswith("mooncake")]
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES) or len(set(modes)) < len(modes):
        raise SystemExit(f"kvrelay bench sglang-server: --modes from {MODES}")
    if why is not None and any(m.startswith("mooncake") for m in modes):
        raise SystemExit(f"kvrelay bench sglang-server: {why}")
    return modes


def run(args: argparse.Namespace) -> dict:
    from kvrelay.model import write_model
    from kvrelay.model.config import ModelConfig
    from kvrelay.model.loader import kv_spec
    from kvrelay.model.make_model import RandomModelSpec

    modes = _modes(args)
    args.redeploy_tp = args.redeploy_tp or args.tp
    args.redeploy_layout = args.redeploy_layout or args.layout
    if min(args.sessions, args.turns, args.system_tokens, args.answer_tokens, args.page_size,
           args.tp, args.redeploy_tp) < 1 or args.redeploy_turns < 0:  # fmt: skip
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
    requests, held = replay(modes, args, model_dir, spec, work)
    result = assemble(args, modes, requests, held)
    result["logs"] = str(work)
    write_report(args, "sglang-server", result)
    sys.stdout.flush()
    return result


def assemble(args, modes: list[str], requests: dict, held: dict) -> dict:
    """The JSON (printing the table): `modes` the turns before any redeploy,
    `redeploy` the turns after it, by mode beside the phase's optimum and
    outputs check."""
    reference = report.reference_mode(modes)
    before = report.phase(requests, range(args.turns), args.page_size, reference)
    rows = report.table_rows("before" if args.redeploy_turns else "all", before["modes"])
    redeploy = None
    if args.redeploy_turns:
        turns = range(args.turns, args.turns + args.redeploy_turns)
        after = report.phase(requests, turns, args.page_size, reference)
        rows += report.table_rows("after", after["modes"])
        redeploy = {"turns": args.redeploy_turns, "tp": args.redeploy_tp,
                    "layout": args.redeploy_layout, "optimum": after["optimum"],
                    "outputs_equal": after["outputs_equal"],
                    "outputs_differ": after["outputs_differ"], "l3_held": held,
                    **after["modes"]}  # fmt: skip
    pair = report.paired(before["modes"], "kvrelay", "file")
    shape = f"TP={args.tp} {args.layout}"
    if args.redeploy_turns:
        shape += (f", then {args.redeploy_turns} turns on TP={args.redeploy_tp} "
                  f"{args.redeploy_layout}")  # fmt: skip
    print(f"{args.sessions} sessions x {args.turns} turns on {shape} (system "
          f"{args.system_tokens}, tool {args.tool_tokens} tokens), device pool "
          f"{args.device_tokens} tokens, host x{args.host_ratio}, caches flushed every "
          f"{args.flush}, servers restarted every {args.restart_every or 'never'} turns; "
          f"optimum hit rate {before['optimum']:.3f}, outputs equal to {reference}'s: "
          f"{before['outputs_equal']} {before['outputs_differ'] or ''}")  # fmt: skip
    if redeploy:
        print(f"after the redeploy: optimum hit rate {redeploy['optimum']:.3f}, outputs "
              f"equal to {reference}'s: {redeploy['outputs_equal']} "
              f"{redeploy['outputs_differ'] or ''}; L3 held before/after: {held}")  # fmt: skip
    print(format_table(report.HEADERS, rows))
    if pair is not None:
        print(f"kvrelay / file TTFT, request by request: median {pair['median_ratio']:.3f} "
              f"(quartiles {pair['p25_ratio']:.3f}-{pair['p75_ratio']:.3f}), kvrelay faster "
              f"in {pair['faster']} of {pair['requests']}")  # fmt: skip
    return {"optimum": before["optimum"], "outputs_equal": before["outputs_equal"],
            "outputs_differ": before["outputs_differ"], "outputs_reference": reference,
            "modes": before["modes"], "kvrelay_over_file": pair, "redeploy": redeploy}  # fmt: skip
