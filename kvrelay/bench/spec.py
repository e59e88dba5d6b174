"""`kvrelay bench spec`: decode tokens/s with and without MTP speculation,
acceptance rate and mean accept length, side by side in one run; and the
prefill time of a long prompt at CP=1 vs CP=2 (`kvrelay.bench.cp`'s
`measure_cp_prefill`).

A random model with an MTP layer is written (optionally fitted to its target
with `--fit-steps`, see `kvrelay.model.mtp_fit`, or built from the target's
first layer with `--mtp-init copy`, which agrees often with a one-layer
target) unless `--model` is given.
One engine per configuration (plain, then K = each of `--k`) is loaded; run
after run, each generates the same greedy continuation of the same prompts
in turn, so a slow phase of the shared machine hits all of them; the
speed-up is taken per run against the plain engine's time of that run. The
tokens must equal the plain run's (greedy speculation is exact).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

from kvrelay.bench.stats import Summary, format_table, write_report
from kvrelay.layout import DEFAULT_PAGE_SIZE
from kvrelay.model.config import TORCH_DTYPES
from kvrelay.model.engine import Request
from kvrelay.model.loader import load_config, load_engine
from kvrelay.model.make_model import add_shape_arguments, shape_spec, write_model
from kvrelay.model.sampling import SamplingParams

SHAPE = {"layers": 4, "hidden": 256, "heads": 8, "kv_heads": 2, "vocab": 1024}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory with an MTP layer (default: random)")
    add_shape_arguments(parser, SHAPE)
    parser.add_argument("--fit-steps", type=int, default=0, help="fit the random MTP layer first")
    parser.add_argument(
        "--mtp-init",
        choices=["random", "copy"],
        default="random",
        help="copy: the MTP layer re-runs the target's first layer (agrees often with --layers 1)",
    )
    parser.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default="float32")
    parser.add_argument("--k", default="1,2,4", help="comma-separated draft lengths")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2, help="requests decoded together")
    parser.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cp-prompt-tokens", type=int, default=2048, help="0: skip the CP half")
    parser.add_argument("--json", metavar="PATH", help="write the results here")


def measure_speculation(model_dir, ks, *, prompt_tokens, decode_tokens, batch, runs, dtype,
                        page_size, seed=0) -> dict:  # fmt: skip
    """Decode tokens/s of the plain engine and of each K, interleaved runs."""
    vocab = load_config(model_dir).vocab_size
    gen = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(0, vocab, (prompt_tokens,), generator=gen).tolist() for _ in range(batch)
    ]
    pages = batch * (-(-(prompt_tokens + decode_tokens) // page_size) + 1)
    options = dict(dtype=dtype, page_size=page_size, num_pages=pages)
    engines = {k: load_engine(model_dir, speculative=k, **options) for k in (0, *ks)}
    rates: dict[int, list[float]] = {k: [] for k in engines}
    stats: dict[int, dict] = {}
    expected = None
    for _ in range(runs):
        for k, engine in engines.items():
            engine.pool.clear_cache()
            if engine.draft is not None:
                engine.draft.pool.clear_cache()
            requests = [Request(p, SamplingParams(decode_tokens)) for p in prompts]
            results = engine.generate(requests)
            tokens = [r.tokens for r in results]
            expected = expected or tokens
            if tokens != expected:
                raise RuntimeError(f"K={k} speculation changed the greedy tokens")
            decoded = sum(len(t) - 1 for t in tokens)
            rates[k].append(decoded / results[0].decode_seconds)
            if k:
                stats[k] = {
                    key: sum(r.spec[key] for r in results)
                    for key in ("proposed", "accepted", "steps")
                }
    base = rates[0]
    report = {}
    for k, values in rates.items():
        entry = {
            "decode_tokens_per_s": Summary.of(values).to_json(),
            "speedup": Summary.of([v / b for v, b in zip(values, base, strict=True)]).to_json(),
        }
        if k:
            s = stats[k]
            entry |= s | {
                "acceptance_rate": s["accepted"] / s["proposed"] if s["proposed"] else 0.0,
                "mean_accept_length": (s["accepted"] + s["steps"]) / s["steps"]
                if s["steps"]
                else 0.0,
            }
        report[k] = entry
    return report


def run(args: argparse.Namespace) -> dict:
    try:
        ks = tuple(int(k) for k in args.k.split(",") if k.strip())
    except ValueError:
        ks = ()
    if not ks or min(ks) < 1 or args.runs < 1 or args.decode_tokens < 2:
        raise SystemExit("kvrelay bench spec: --k wants positive draft lengths; --runs >= 1")
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            spec = shape_spec(args, arch="llama", dtype=args.dtype, mtp=1, mtp_init=args.mtp_init)
            model_dir = write_model(f"{tmp}/model", spec)
            if args.fit_steps:
                from kvrelay.model.mtp_fit import fit_mtp

                fit_mtp(model_dir, args.fit_steps)
        spec_report = measure_speculation(
            model_dir, ks, prompt_tokens=args.prompt_tokens, decode_tokens=args.decode_tokens,
            batch=args.batch, runs=args.runs, dtype=args.dtype, page_size=args.page_size,
        )  # fmt: skip
        cp_report = None
        if args.cp_prompt_tokens:
            from kvrelay.bench.cp import measure_cp_prefill

            cp_report = measure_cp_prefill(
                model_dir, prompt_tokens=args.cp_prompt_tokens, runs=args.runs, dtype=args.dtype,
                page_size=args.page_size,
            )  # fmt: skip
    load_after = os.getloadavg()
    _print(args, spec_report, cp_report, load_before, load_after)
    result = {"speculation": spec_report, "cp_prefill": cp_report,
              "load_average": {"before": load_before, "after": load_after}}  # fmt: skip
    write_report(args, "spec", result)
    sys.stdout.flush()
    return result


def _cell(summary: dict, fmt: str) -> str:
    return f"{summary['median']:{fmt}} [{summary['min']:{fmt}}-{summary['max']:{fmt}}]"


def _print(args, spec_report, cp_report, load_before, load_after) -> None:
    print(f"greedy decode of {args.batch} x {args.decode_tokens} tokens after a "
          f"{args.prompt_tokens}-token prompt, {args.runs} runs (load average "
          f"{load_before[0]:.1f} before, {load_after[0]:.1f} after)")  # fmt: skip
    rows = []
    for k, r in spec_report.items():
        rows.append([k or "off", _cell(r["decode_tokens_per_s"], ".1f"), _cell(r["speedup"], ".2f"),
                     f"{r['acceptance_rate']:.1%}" if k else "-",
                     f"{r['mean_accept_length']:.2f}" if k else "-"])  # fmt: skip
    print(format_table(["K", "decode tok/s", "x off", "acceptance", "accept length"], rows))
    if cp_report is not None:
        print(f"\nprefill of a {cp_report['prompt_tokens']}-token prompt")
        rows = [[cp, _cell(r["prefill_s"], ".3f"), _cell(r["speedup"], ".2f")]
                for cp, r in cp_report["cp"].items()]  # fmt: skip
        print(format_table(["cp", "prefill s", "x CP=1"], rows))
