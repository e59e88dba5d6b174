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
context already in the pool): compute and nothing else. `x_floor` is the sum
of the phases over the floor; `x_floor_move` adds to the floor two copies of
the context's KV at memcpy speed (prefill's and decode's), the issue's goal
reference. Peak memory is the RSS high-water mark above the phase's start,
sampled every 5 ms.

Control's per-request work is measured apart from the rest (it runs in
control's process, beside the request's others): its CPU path without the
network, from the completion's JSON body to the decode message, as
`dispatch.py` does it: the body parsed, the prompt's page keys once
(`Job.page_keys`), the estimate probes of the prefill and decode orders, the
prefill and decode messages' packed tokens, and the keys of prompt + first
token added to a worker's estimate after prefill and decode.
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
from kvrelay.model.config import TORCH_DTYPES
from kvrelay.model.engine import Request
from kvrelay.model.loader import load_engine
from kvrelay.model.make_model import RandomModelSpec, write_model
from kvrelay.model.page_export import export_prefix, import_prefix
from kvrelay.model.sampling import SamplingParams
from kvrelay.prefill.ranks import TIER_WINDOW

PHASES = ("control", "lookup", "tier_pull", "compute", "stage", "decode_pull")
CONTEXTS = {"8K": 8192, "32K": 32768, "128K": 131072, "200K": 204800, "512K": 524288,
            "1M": 1048576}  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory (default: the demo model's shape)")
    parser.add_argument(
        "--contexts",
        default="8K,32K,128K",
        help=f"cached context lengths: {', '.join(CONTEXTS)} or a token count",
    )
    parser.add_argument("--new-tokens", type=int, default=2048)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default="float32")
    parser.add_argument("--max-prefill-tokens", type=int, default=4096)
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
    from kvrelay.demo.command import DEMO_MODEL

    spec = RandomModelSpec(**{**DEMO_MODEL, "max_positions": 1 << 21}, seed=7)
    return write_model(root / "model", spec)


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


def control_work(body: bytes, page_size: int, first_token: int) -> int:
    """Control's CPU work for one request (see the module's doc); returns
    the prompt's pages."""
    from types import SimpleNamespace

    from kvrelay.rpc import pack_tokens

    tokens = json.loads(body)["prompt"]
    estimate = PageEstimate(MAX_ESTIMATE_PAGES)
    node = SimpleNamespace(
        namespace=b"\x01" * 32, page_size=page_size, estimate=estimate, key_scheme="kvrelay"
    )
    job = Job("bench", "model", tokens, {"max_new_tokens": 2})
    keys = job.page_keys(node)
    estimate.hit(keys)  # the prefill order
    pack_tokens(tokens)  # the Prefill message
    estimate.add(job.page_keys(node, tokens))
    estimate.hit(keys)  # the decode order
    prompt = [*tokens, first_token]
    pack_tokens(prompt)  # the Decode message
    estimate.add(job.page_keys(node, prompt))
    return len(keys)


def measure(model_dir: Path, context: int, args) -> dict:
    ps, new = args.page_size, args.new_tokens
    gen = torch.Generator().manual_seed(context)
    vocab = 256
    tokens = torch.randint(0, vocab, (context + new,), generator=gen).tolist()
    other = torch.randint(0, vocab, (new,), generator=gen).tolist()
    pages = -(-(context + new + 1) // ps) + 1
    options = dict(dtype=args.dtype, page_size=ps, max_prefill_tokens=args.max_prefill_tokens)
    prefill = load_engine(model_dir, num_pages=pages + pages // 4 + 4, **options)
    decode = load_engine(model_dir, num_pages=pages + 4, **options)
    page_bytes = prefill.spec.page_bytes
    # The tier's stand-in: one window of synthetic page bytes (finite values).
    window = torch.randn(TIER_WINDOW * page_bytes // 4, generator=gen).view(torch.uint8)
    window = window.view(TIER_WINDOW, page_bytes)
    context_pages = context // ps
    times, peaks = {}, {}

    def phase(name, fn):
        with PeakRSS() as mem:
            start = time.perf_counter()
            out = fn()
            times[name] = time.perf_counter() - start
        peaks[name] = mem.grown
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
    total_pages = -(-len(tokens) // ps)
    staging = torch.zeros(total_pages - context_pages, page_bytes, dtype=torch.uint8)
    rows = list(range(staging.size(0)))
    phase("stage", lambda: export_prefix(prefill, tokens, staging, rows, context_pages, keys))

    def decode_pull():
        _window_import(decode, tokens, keys, context_pages, window)
        import_prefix(decode, tokens, staging, rows, chain=keys, first_page=context_pages)

    phase("decode_pull", decode_pull)
    floor_tokens = tokens[:context] + other
    with PeakRSS() as mem:
        floor_result = prefill.generate([Request(floor_tokens, SamplingParams(1))])[0]
    floor_s, floor_peak = floor_result.prefill_seconds, mem.grown
    # Two copies of the context's KV bytes (prefill's pool, decode's) at memcpy speed.
    copy_to = torch.empty_like(window)
    start = time.perf_counter()
    for _ in range(-(-context_pages // TIER_WINDOW)):
        copy_to.copy_(window)
    memcpy_s = 2 * (time.perf_counter() - start)
    assert result.cached_tokens == context and floor_result.cached_tokens == context
    total = sum(times.values())
    return {
        "context": context,
        "new_tokens": new,
        "pages": total_pages,
        "phases_s": times,
        "phase_peak_rss_bytes": peaks,
        "total_s": total,
        "floor_s": floor_s,
        "floor_peak_rss_bytes": floor_peak,
        "memcpy_context_twice_s": memcpy_s,
        "x_floor": total / floor_s,
        "x_floor_move": total / (floor_s + memcpy_s),
        "non_compute_s": total - times["compute"],
        "non_compute_per_page_us": 1e6 * (total - times["compute"]) / total_pages,
        "control_per_page_us": 1e6 * times["control"] / total_pages,
        "pool_bytes": (prefill.pool.storage.numel() + decode.pool.storage.numel())
        * prefill.pool.storage.element_size(),
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
    if args.new_tokens <= 0 or args.max_prefill_tokens <= 0:
        raise SystemExit("--new-tokens and --max-prefill-tokens must be positive")
    info = machine_info() | {"load_average": list(os.getloadavg())}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _model(args, Path(tmp))
        results = []
        for context in contexts:
            results.append(measure(model_dir, context, args))
            print(f"context {context}: done", file=sys.stderr)
    headers = ["context", *PHASES, "total", "floor", "x_floor", "x_floor_move", "us/page*",
               "ctl us/page"]  # fmt: skip
    rows = []
    for r in results:
        p = r["phases_s"]
        rows.append([r["context"], *(f"{p[n]:.3f}" for n in PHASES), f"{r['total_s']:.3f}",
                     f"{r['floor_s']:.3f}", f"{r['x_floor']:.2f}", f"{r['x_floor_move']:.2f}",
                     f"{r['non_compute_per_page_us']:.0f}",
                     f"{r['control_per_page_us']:.1f}"])  # fmt: skip
    print(format_table(headers, rows))
    print("* non-compute time per page of the prompt (us); seconds elsewhere")
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
