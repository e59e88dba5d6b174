"""`kvrelay bench scale`: how a request's cost grows with its cached context.

For each context length (default 8K, 32K, 128K tokens; 512K and 1M by flag)
and a fixed number of new tokens, one process runs the serving path's own
functions phase by phase, on a demo-sized model:

* lookup: the prompt's page keys and the prefill pool's prefix match;
* tier pull: the context's pages imported into the prefill pool through a
  window of `TIER_WINDOW` staging rows (`import_prefix`, as the prefill ranks
  do after a tier lookup; the window's bytes stand in for the tier's, so the
  cached KV is synthetic and the time is the copy and indexing work);
* compute: `Engine.generate` of the prompt, which computes only the new
  tokens over the imported context (chunked prefill, paged attention);
* stage: `export_prefix` of only the pages after the context (what prefill
  publishes);
* decode pull: the decode pool takes the context through the same window
  and the new pages from the staging rows (`import_prefix`).

The floor is a monolithic prefill of only the new tokens over the same
cached context in one process (other new tokens after the same context, the
context already in the pool; the whole `generate` call, timed as compute
is): compute and nothing else. Load on a shared machine swings compute by
tens of percent between two runs minutes apart, so each context runs
`--repeats` pairs of (tier run, floor run) interleaved A B B A A B ... (both
pools emptied before each tier run, fresh new tokens for each floor run):
`x_floor` is the median of the pairs' own ratios of the phases' sum over the
floor, with their min and max; `x_floor_move` adds to the floor two copies of
the context's KV at memcpy speed (prefill's and decode's), the issue's goal
reference. Peak memory is the RSS high-water mark above the phase's start,
sampled every 5 ms.

Control's per-request work is measured apart from the rest (it runs in
control's process, beside the request's others): its CPU path without the
network, from the completion's JSON body to the decode message, as the
route and `dispatch.py` do it: the body decoded (`fast_json`) and validated
(`CompletionRequest`), the vocabulary check, the prompt's page keys once
(`Job.page_keys`), the estimate probes of the prefill and decode orders, the
prefill and decode messages' packed tokens (`Job.packed`), and the keys of
prompt + first token added to a worker's estimate after prefill and decode.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from kvrelay.bench.stats import format_table, machine_info, write_json
from kvrelay.control.dispatch import Job
from kvrelay.control.registry import MAX_ESTIMATE_PAGES, PageEstimate
from kvrelay.demo.profiles import MLA_MODELS, MODELS
from kvrelay.layout import DEFAULT_PAGE_SIZE
from kvrelay.model.config import TORCH_DTYPES
from kvrelay.model.engine import Request
from kvrelay.model.loader import load_engine
from kvrelay.model.make_mla_model import MLA_ARCHS, MlaModelSpec, write_mla_model
from kvrelay.model.make_model import RandomModelSpec, write_model
from kvrelay.model.page_export import export_prefix, import_prefix
from kvrelay.model.sampling import SamplingParams
from kvrelay.prefill.ranks import TIER_WINDOW

PHASES = ("control", "lookup", "tier_pull", "compute", "stage", "decode_pull")
CONTEXTS = {"8K": 8192, "32K": 32768, "128K": 131072, "200K": 204800, "512K": 524288,
            "1M": 1048576}  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory (default: the demo model's shape)")
    parser.add_argument("--arch", default="llama", choices=["llama", *MLA_ARCHS],
                        help="the default model's family (the demo's shape of it)")  # fmt: skip
    parser.add_argument(
        "--contexts",
        default="8K,32K,128K",
        help=f"cached context lengths: {', '.join(CONTEXTS)} or a token count",
    )
    parser.add_argument("--new-tokens", type=int, default=2048)
    parser.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE)
    parser.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default="float32")
    parser.add_argument("--max-prefill-tokens", type=int, default=4096)
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="pairs of (tier run, floor run) per context, interleaved A B B A; medians reported",
    )
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--plot", metavar="PNG", help="phase time against context length")


class PeakRSS:
    """High-water mark of this process's RSS while a phase runs (sampled)."""

    def __init__(self) -> None:
        self.page = 4096
        self.peak = 0
        self._stop = threading.Event()

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def __enter__(self):
        self.start = self.rss()
        self.peak = self.start
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.rss())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())

    @property
    def grown(self) -> int:
        return self.peak - self.start


def _model(args, root: Path) -> Path:
    if args.model:
        return Path(args.model)
    shapes = MODELS if args.arch == "llama" else MLA_MODELS
    shape = {**shapes["default"], "max_positions": 1 << 21}
    if args.arch != "llama":
        return write_mla_model(root / "model", MlaModelSpec(arch=args.arch, **shape, seed=7))
    return write_model(root / "model", RandomModelSpec(**shape, seed=7))


def _window_import(engine, tokens, keys, pages: int, window: torch.Tensor) -> None:
    """The first `pages` pages of `tokens` into the pool, TIER_WINDOW rows at a time."""
    rows = list(range(window.size(0)))
    tokens = np.asarray(tokens)  # sliced per window in O(1), as the prefill ranks do
    position = 0
    while position < pages:
        count = min(len(rows), pages - position)
        end = (position + count) * engine.spec.page_size
        import_prefix(engine, tokens[:end], window, rows[:count], chain=keys, first_page=position)
        position += count


def control_work(body: bytes, page_size: int, first_token: int, vocab: int = 256) -> int:
    """Control's CPU work for one request (see the module's doc); returns
    the prompt's pages."""
    from types import SimpleNamespace

    from kvrelay.control.fast_json import decode_json
    from kvrelay.control.schemas import CompletionRequest

    request = CompletionRequest.model_validate(decode_json(body))  # as the route's body
    tokens = list(request.prompt)
    assert min(tokens) >= 0 and max(tokens) < vocab  # the completion's vocabulary check
    estimate = PageEstimate(MAX_ESTIMATE_PAGES)
    node = SimpleNamespace(
        namespace=b"\x01" * 32, page_size=page_size, estimate=estimate, key_scheme="kvrelay"
    )
    job = Job("bench", "model", tokens, {"max_new_tokens": 2})
    keys = job.page_keys(node)
    estimate.hit(keys)  # the prefill order
    job.packed(tokens)  # the Prefill message
    estimate.add(job.page_keys(node, tokens))
    estimate.hit(keys)  # the decode order
    prompt = [*tokens, first_token]
    job.packed(prompt)  # the Decode message
    estimate.add(job.page_keys(node, prompt))
    return len(keys)


def _engines(model_dir: Path, context: int, args):
    ps, new = args.page_size, args.new_tokens
    pages = -(-(context + new + 1) // ps) + 1
    options = dict(dtype=args.dtype, page_size=ps, max_prefill_tokens=args.max_prefill_tokens)
    # Prefill's pool holds the context, the tier run's new pages and two floor
    # runs' (A B B A order): LRU eviction must never take the context.
    spare = 3 * (-(-new // ps) + 2)
    prefill = load_engine(model_dir, num_pages=pages + spare + 4, **options)
    decode = load_engine(model_dir, num_pages=pages + 4, **options)
    return prefill, decode


def _timed(fn) -> tuple[float, int, object]:
    with PeakRSS() as mem:
        start = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - start
    return seconds, mem.grown, out


def _tier_run(prefill, decode, tokens, window, args) -> tuple[dict, dict]:
    """One request through every phase, both pools cold (the context comes
    from the tier's stand-in)."""
    ps, context = args.page_size, len(tokens) - args.new_tokens
    context_pages = context // ps
    prefill.pool.clear_cache()
    decode.pool.clear_cache()
    times, peaks = {}, {}

    def phase(name, fn):
        times[name], peaks[name], out = _timed(fn)
        return out

    body = json.dumps({"prompt": tokens, "max_tokens": 2}).encode()
    phase("control", lambda: control_work(body, ps, 0))

    def lookup():
        keys = prefill.spec.page_keys(tokens)
        prefill.pool.release(prefill.pool.match_prefix(keys))
        return keys

    keys = phase("lookup", lookup)
    phase("tier_pull", lambda: _window_import(prefill, tokens, keys, context_pages, window))
    result = phase("compute", lambda: prefill.generate([Request(tokens, SamplingParams(1))])[0])
    assert result.cached_tokens == context, (result.cached_tokens, context)
    staging = torch.zeros(-(-len(tokens) // ps) - context_pages, prefill.spec.page_bytes,
                          dtype=torch.uint8)  # fmt: skip
    rows = list(range(staging.size(0)))
    phase("stage", lambda: export_prefix(prefill, tokens, staging, rows, context_pages, keys))

    def decode_pull():
        _window_import(decode, tokens, keys, context_pages, window)
        import_prefix(decode, tokens, staging, rows, chain=keys, first_page=context_pages)

    phase("decode_pull", decode_pull)
    return times, peaks


def _floor_run(prefill, context_tokens: list[int], other: list[int]) -> tuple[float, int]:
    """Only the new tokens' compute over the context, already in the pool:
    the whole `generate` call, as the tier run's compute phase is timed."""
    seconds, grown, result = _timed(
        lambda: prefill.generate([Request(context_tokens + other, SamplingParams(1))])[0]
    )
    assert result.cached_tokens == len(context_tokens), (result.cached_tokens, len(context_tokens))
    return seconds, grown


def _memcpy_twice(window: torch.Tensor, context_pages: int) -> float:
    """Two copies of the context's KV bytes (prefill's pool, decode's) at memcpy speed."""
    copy_to = torch.empty_like(window)
    start = time.perf_counter()
    for _ in range(-(-context_pages // TIER_WINDOW)):
        copy_to.copy_(window)
    return 2 * (time.perf_counter() - start)


def measure(model_dir: Path, context: int, args) -> dict:
    """`args.repeats` pairs of (tier run, floor run), interleaved A B B A A B
    ... so that drift and load spikes fall on both sides; each pair's ratio
    is its own, and the figures are medians across pairs."""
    ps, new = args.page_size, args.new_tokens
    gen = torch.Generator().manual_seed(context)
    vocab = 256
    tokens = torch.randint(0, vocab, (context + new,), generator=gen).tolist()
    prefill, decode = _engines(model_dir, context, args)
    # The tier's stand-in: one window of synthetic page bytes (finite values).
    window = torch.randn(TIER_WINDOW * prefill.spec.page_bytes // 4, generator=gen)
    window = window.view(torch.uint8).view(TIER_WINDOW, prefill.spec.page_bytes)
    pairs = []
    for rep in range(args.repeats):
        other = torch.randint(0, vocab, (new,), generator=gen).tolist()  # fresh new tokens
        order = ("tier", "floor") if rep % 2 == 0 else ("floor", "tier")
        pair = {"order": "".join(o[0] for o in order), "load_average": os.getloadavg()[0]}
        for which in order:
            if which == "tier":
                pair["phases_s"], pair["phase_peak_rss_bytes"] = _tier_run(
                    prefill, decode, tokens, window, args
                )
            else:  # the tier run of this pair or the previous one left the context cached
                pair["floor_s"], pair["floor_peak_rss_bytes"] = _floor_run(
                    prefill, tokens[:context], other
                )
        pair["memcpy_context_twice_s"] = _memcpy_twice(window, context // ps)
        pair["total_s"] = sum(pair["phases_s"].values())
        pair["x_floor"] = pair["total_s"] / pair["floor_s"]
        pair["x_floor_move"] = pair["total_s"] / (pair["floor_s"] + pair["memcpy_context_twice_s"])
        pairs.append(pair)
        print(f"context {context} pair {rep + 1}/{args.repeats} ({pair['order']}): "
              f"x_floor {pair['x_floor']:.3f}, load {pair['load_average']:.1f}",
              file=sys.stderr)  # fmt: skip
    return _summary(context, new, pairs, prefill, decode, ps)


def _median(values) -> float:
    return float(np.median(values))


def _summary(context: int, new: int, pairs: list[dict], prefill, decode, ps: int) -> dict:
    total_pages = -(-(context + new) // ps)
    phases = {n: _median([p["phases_s"][n] for p in pairs]) for n in PHASES}
    total = _median([p["total_s"] for p in pairs])
    non_compute = _median([p["total_s"] - p["phases_s"]["compute"] for p in pairs])
    ratios = [p["x_floor"] for p in pairs]
    return {
        "context": context,
        "new_tokens": new,
        "pages": total_pages,
        "repeats": len(pairs),
        "phases_s": phases,
        "phase_peak_rss_bytes": {
            n: max(p["phase_peak_rss_bytes"][n] for p in pairs) for n in PHASES
        },
        "total_s": total,
        "floor_s": _median([p["floor_s"] for p in pairs]),
        "floor_peak_rss_bytes": max(p["floor_peak_rss_bytes"] for p in pairs),
        "memcpy_context_twice_s": _median([p["memcpy_context_twice_s"] for p in pairs]),
        "x_floor": _median(ratios),  # the median of the pairs' own ratios
        "x_floor_min": min(ratios),
        "x_floor_max": max(ratios),
        "x_floor_move": _median([p["x_floor_move"] for p in pairs]),
        "non_compute_s": non_compute,
        "non_compute_per_page_us": 1e6 * non_compute / total_pages,
        "control_per_page_us": 1e6 * phases["control"] / total_pages,
        "pool_bytes": prefill.pool.nbytes + decode.pool.nbytes,
        "pairs": pairs,
    }


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = [r["context"] for r in results]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in PHASES:
        ax.plot(contexts, [r["phases_s"][name] for r in results], marker="o", label=name)
    ax.plot(contexts, [r["floor_s"] for r in results], "k--", marker="s", label="floor")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("cached context (tokens)")
    ax.set_ylabel("seconds")
    ax.set_title(f"kvrelay bench scale: {results[0]['new_tokens']} new tokens")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _context(text: str) -> int:
    value = CONTEXTS[text] if text in CONTEXTS else int(text)
    if value <= 0:
        raise ValueError(text)
    return value


def run(args: argparse.Namespace) -> None:
    try:
        contexts = [_context(c.strip()) for c in args.contexts.split(",") if c.strip()]
    except ValueError:
        raise SystemExit(
            f"--contexts: lengths are token counts or one of {list(CONTEXTS)}"
        ) from None
    if min(args.new_tokens, args.max_prefill_tokens, args.repeats) <= 0:
        raise SystemExit("--new-tokens, --max-prefill-tokens and --repeats must be positive")
    info = machine_info() | {"load_average": list(os.getloadavg())}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _model(args, Path(tmp))
        results = []
        for context in contexts:
            results.append(measure(model_dir, context, args))
            print(f"context {context}: done", file=sys.stderr)
    headers = ["context", *PHASES, "total", "floor", "x_floor [min-max]", "x_floor_move",
               "us/page*", "ctl us/page"]  # fmt: skip
    rows = []
    for r in results:
        p = r["phases_s"]
        rows.append([r["context"], *(f"{p[n]:.3f}" for n in PHASES), f"{r['total_s']:.3f}",
                     f"{r['floor_s']:.3f}",
                     f"{r['x_floor']:.2f} [{r['x_floor_min']:.2f}-{r['x_floor_max']:.2f}]",
                     f"{r['x_floor_move']:.2f}",
                     f"{r['non_compute_per_page_us']:.0f}",
                     f"{r['control_per_page_us']:.1f}"])  # fmt: skip
    print(format_table(headers, rows))
    print(
        "* non-compute time per page of the prompt (us); seconds elsewhere; medians of "
        f"{args.repeats} interleaved (tier, floor) pairs, x_floor the median of their ratios"
    )
    peak = [[r["context"], *(f"{r['phase_peak_rss_bytes'][n] / 2**20:.0f}" for n in PHASES),
             f"{r['floor_peak_rss_bytes'] / 2**20:.0f}", f"{r['pool_bytes'] / 2**20:.0f}"]
            for r in results]  # fmt: skip
    print(format_table(["context", *(f"{n} MiB" for n in PHASES), "floor MiB", "pools MiB"], peak))
    print(f"load average {info.get('load_average')}")
    if args.plot:
        plot(results, args.plot)
    if args.json:
        write_json(args.json, {"machine": info, "args": vars(args) | {"func": None},
                               "results": results})  # fmt: skip
