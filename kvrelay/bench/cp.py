"""`kvrelay bench cp`: prefill time of one long prompt at CP=1 vs CP=2 (or any
CP degrees), side by side in one run.

Every degree runs as a `ParallelEngine` (CP=1 too, so each rank is one
process with one intra-op thread whatever the degree, and CP=C uses C
cores). The groups are started together and, run after run, each prefills
the same prompt from an empty cache (one new token) in turn, so a slow phase
of a shared machine hits all of them; the speed-up is taken per run against
CP=1's time of that run. The first tokens must agree across degrees.

`measure_cp_prefill` is the function other benchmarks (`kvrelay bench spec`)
call for their CP half.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from contextlib import ExitStack

import torch

from kvrelay.bench.stats import Summary, format_table, write_report
from kvrelay.layout import DEFAULT_PAGE_SIZE
from kvrelay.model.config import TORCH_DTYPES
from kvrelay.model.engine import Request
from kvrelay.model.make_model import add_shape_arguments, shape_spec, write_model
from kvrelay.model.sampling import SamplingParams

SHAPE = {"layers": 4, "hidden": 256, "heads": 8, "kv_heads": 2, "vocab": 1024}


def measure_cp_prefill(
    model_dir,
    *,
    prompt_tokens: int = 4096,
    cps: tuple[int, ...] = (1, 2),
    runs: int = 3,
    dtype: str = "float32",
    page_size: int = DEFAULT_PAGE_SIZE,
    seed: int = 0,
    timeout_s: float = 600.0,
) -> dict:
    """Prefill seconds of a `prompt_tokens`-token prompt under each CP degree
    in `cps` (the first is the baseline), `runs` interleaved runs each.
    Returns {"prompt_tokens", "runs", "load_average", "cp": {C: {"prefill_s",
    "tokens_per_s", "speedup"}}} with Summary JSON values ("speedup": the
    baseline's time / this degree's, per run)."""
    from kvrelay.model.loader import load_config
    from kvrelay.model.parallel import ParallelEngine

    vocab = load_config(model_dir).vocab_size
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (prompt_tokens,), generator=generator).tolist()
    pages = -(-(prompt_tokens + 1) // page_size) + 1
    times: dict[int, list[float]] = {cp: [] for cp in cps}
    firsts: dict[int, set[int]] = {cp: set() for cp in cps}
    load_before = os.getloadavg()
    with ExitStack() as stack:
        options = dict(dtype=dtype, page_size=page_size, num_pages=pages, timeout_s=timeout_s)
        groups = {
            cp: stack.enter_context(ParallelEngine(model_dir, cp=cp, **options)) for cp in cps
        }
        for _ in range(runs):
            for cp, group in groups.items():
                group.clear_cache()
                result = group.generate([Request(prompt, SamplingParams(1))])[0]
                times[cp].append(result.prefill_seconds)
                firsts[cp].add(result.tokens[0])
    if len({frozenset(f) for f in firsts.values()}) != 1:
        raise RuntimeError(f"CP degrees disagree on the first token: {firsts}")
    base = times[cps[0]]
    report = {}
    for cp in cps:
        report[cp] = {
            "prefill_s": Summary.of(times[cp]).to_json(),
            "tokens_per_s": Summary.of([prompt_tokens / t for t in times[cp]]).to_json(),
            "speedup": Summary.of([b / t for b, t in zip(base, times[cp], strict=True)]).to_json(),
        }
    return {
        "prompt_tokens": prompt_tokens,
        "runs": runs,
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "cp": report,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory (default: a random demo model)")
    add_shape_arguments(parser, SHAPE)
    parser.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default="float32")
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--cp", default="1,2", help="comma-separated CP degrees (first: baseline)")
    parser.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", metavar="PATH", help="write the results here")


def _cps(text: str) -> tuple[int, ...]:
    try:
        cps = tuple(int(c) for c in text.split(",") if c.strip())
    except ValueError:
        cps = ()
    if not cps or min(cps) < 1 or len(set(cps)) != len(cps):
        raise SystemExit(f"kvrelay bench cp: --cp wants distinct positive degrees, got {text!r}")
    return cps


def run(args: argparse.Namespace) -> dict:
    cps = _cps(args.cp)
    if args.prompt_tokens < 2 or args.runs < 1:
        raise SystemExit("kvrelay bench cp: --prompt-tokens must be >= 2 and --runs >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            positions = max(16384, 2 * args.prompt_tokens)
            spec = shape_spec(args, arch="llama", dtype=args.dtype, max_positions=positions)
            model_dir = write_model(f"{tmp}/model", spec)
        result = measure_cp_prefill(
            model_dir, prompt_tokens=args.prompt_tokens, cps=cps, runs=args.runs,
            dtype=args.dtype, page_size=args.page_size,
        )  # fmt: skip
    rows = []
    for cp, r in result["cp"].items():
        t, s = Summary(**_plain(r["prefill_s"])), Summary(**_plain(r["speedup"]))
        rows.append([cp, f"{t.median:.3f} [{t.min:.3f}-{t.max:.3f}]",
                     f"{args.prompt_tokens / t.median:.0f}",
                     f"{s.median:.2f} [{s.min:.2f}-{s.max:.2f}]"])  # fmt: skip
    print(f"prefill of a {args.prompt_tokens}-token prompt, {args.runs} runs "
          f"(load average {result['load_average']['before'][0]:.1f} before, "
          f"{result['load_average']['after'][0]:.1f} after)")  # fmt: skip
    print(format_table(["cp", "prefill s", "tok/s", f"x CP={cps[0]}"], rows))
    write_report(args, "cp", result)
    sys.stdout.flush()
    return result


def _plain(summary: dict) -> dict:
    return {k: summary[k] for k in ("median", "min", "max", "runs")}
