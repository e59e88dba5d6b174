"""`kvrelay bench model`: the reference runner against HF transformers.

A demo-sized random model (default 8 layers, hidden 512, 8 heads, 2 KV
heads, float32) is written to a temporary directory and loaded by both. For
each context length, every run times, back to back on the same prompt:

* HF transformers (SDPA) prefill of the prompt (logits of the last position
  only, as a server computes) and `decode` single-token steps through its cache;
* kvrelay prefill from an empty cache and `decode` steps (the engine's own
  timers);
* kvrelay prefill of the same prompt when 90 % of it is a cached prefix.

Ratios are taken per run (HF time / kvrelay time; cold / warm prefill), then
summarised as median [min-max], so slow phases of a noisy machine hit both.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvrelay.bench.stats import Summary, format_table, machine_info, write_json
from kvrelay.layout import DEFAULT_PAGE_SIZE
from kvrelay.model.config import TORCH_DTYPES
from kvrelay.model.engine import Request
from kvrelay.model.loader import load_engine
from kvrelay.model.make_model import add_shape_arguments, shape_spec, write_model
from kvrelay.model.sampling import SamplingParams

SHAPE = {"layers": 8, "hidden": 512, "heads": 8, "kv_heads": 2, "vocab": 32000}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory (default: a random demo model)")
    parser.add_argument("--arch", choices=["llama", "qwen2"], default="llama")
    add_shape_arguments(parser, SHAPE)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default="float32")
    parser.add_argument("--contexts", default="2048,8192", help="comma-separated prompt lengths")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--hit", type=float, default=0.9, help="cached fraction of the prompt")
    parser.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", metavar="PATH", help="write the results here")


class _HFRunner:
    def __init__(self, model_dir, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=dtype, attn_implementation="sdpa"
        ).eval()

    @torch.no_grad()
    def run(self, prompt: list[int], decode_tokens: int) -> tuple[float, float, list[int]]:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        start = time.perf_counter()
        out = self.model(torch.tensor([prompt]), cache=cache, use_cache=True, logits_to_keep=1)
        token = int(out.logits[0, -1].argmax())
        prefilled = time.perf_counter()
        tokens = [token]
        for _ in range(decode_tokens):
            out = self.model(torch.tensor([[token]]), cache=cache, use_cache=True)
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
        return prefilled - start, time.perf_counter() - prefilled, tokens


def measure(model_dir, args, context: int) -> dict:
    gen = torch.Generator().manual_seed(context)
    vocab = args.vocab
    prompt = torch.randint(0, vocab, (context,), generator=gen).tolist()
    pages = 2 * (-(-(context + args.decode_tokens + 1) // args.page_size)) + 2
    engine = load_engine(model_dir, dtype=args.dtype, page_size=args.page_size, num_pages=pages)
    hf = _HFRunner(model_dir, TORCH_DTYPES[args.dtype])
    # The hit is rounded down to full pages, as the cache tier serves them.
    cached = int(context * args.hit) // args.page_size * args.page_size
    greedy = SamplingParams(max_new_tokens=args.decode_tokens + 1)
    times: dict[str, list[float]] = {
        k: [] for k in ("hf_prefill", "hf_decode", "prefill", "decode", "prefill_hit")
    }
    # Warm-up on a short prompt: first calls, allocator, kernel selection.
    hf.run(prompt[:256], 2)
    engine.generate([Request(prompt[:256], SamplingParams(3))])
    hit_tokens = same_tokens = None
    for _ in range(args.runs):
        hf_prefill, hf_decode, hf_tokens = hf.run(prompt, args.decode_tokens)
        engine.pool.clear_cache()
        cold = engine.generate([Request(prompt, greedy)])[0]
        engine.pool.clear_cache()
        engine.generate([Request(prompt[:cached], SamplingParams(1))])
        warm = engine.generate([Request(prompt, SamplingParams(1))])[0]
        hit_tokens = warm.cached_tokens
        same_tokens = cold.tokens == hf_tokens
        print(
            f"context {context}: HF prefill {hf_prefill:.2f} s, decode {hf_decode:.2f} s; "
            f"kvrelay prefill {cold.prefill_seconds:.2f} s, decode {cold.decode_seconds:.2f} s, "
            f"prefill with {warm.cached_tokens} cached {warm.prefill_seconds:.2f} s",
            file=sys.stderr,
        )
        times["hf_prefill"].append(hf_prefill)
        times["hf_decode"].append(hf_decode)
        times["prefill"].append(cold.prefill_seconds)
        times["decode"].append(cold.decode_seconds)
        times["prefill_hit"].append(warm.prefill_seconds)
    decode = args.decode_tokens
    per_run = list(zip(*times.values(), strict=True))
    result = {
        "context": context,
        "decode_tokens": decode,
        "cached_tokens": hit_tokens,
        "greedy_tokens_equal_hf": same_tokens,
        "prefill_tok_s": Summary.of([context / t for t in times["prefill"]]),
        "hf_prefill_tok_s": Summary.of([context / t for t in times["hf_prefill"]]),
        "decode_tok_s": Summary.of([decode / t for t in times["decode"]]),
        "hf_decode_tok_s": Summary.of([decode / t for t in times["hf_decode"]]),
        "prefill_vs_hf": Summary.of([hp / p for hp, _, p, _, _ in per_run]),
        "decode_vs_hf": Summary.of([hd / d for _, hd, _, d, _ in per_run]),
        "prefill_hit_s": Summary.of(times["prefill_hit"]),
        "prefill_cold_s": Summary.of(times["prefill"]),
        "hit_saved_fraction": Summary.of([1 - w / p for _, _, p, _, w in per_run]),
    }
    del engine, hf
    return result


def run(args: argparse.Namespace) -> dict:
    contexts = [int(c) for c in str(args.contexts).split(",") if c]
    if args.runs < 1 or not contexts or min(contexts) < 2 or args.decode_tokens < 1:
        raise SystemExit("--runs, --decode-tokens must be >= 1 and contexts >= 2")
    if not 0 < args.hit < 1:
        raise SystemExit("--hit must lie in (0, 1)")
    with tempfile.TemporaryDirectory(prefix="kvrelay-bench-model-") as tmp:
        model_dir = args.model
        if model_dir is None:
            spec = shape_spec(
                args,
                arch=args.arch,
                intermediate=args.intermediate,
                max_positions=max(contexts) + args.decode_tokens + 1,
                dtype=args.dtype if args.dtype != "float64" else "float32",
            )
            model_dir = write_model(Path(tmp) / "model", spec)
        results = [measure(model_dir, args, context) for context in contexts]
    rows = [_row(r) for r in results]
    print(
        format_table(
            [
                "context",
                "prefill tok/s",
                "HF prefill tok/s",
                "x HF",
                "decode tok/s",
                "HF decode tok/s",
                "x HF",
                f"prefill s, {args.hit:.0%} hit",
                "saved",
            ],
            rows,
        )
    )
    print(
        "median of runs [min-max]; x HF = HF time / kvrelay time per run; saved = 1 - "
        "prefill time with the cached prefix / cold prefill time, per run"
    )
    payload = {
        "benchmark": "model",
        "config": {k: v for k, v in vars(args).items() if not callable(v)},
        "machine": machine_info() | {"threads": torch.get_num_threads()},
        "results": [
            {k: v.to_json() if isinstance(v, Summary) else v for k, v in r.items()} for r in results
        ],
    }
    if args.json:
        write_json(args.json, payload)
    return payload


def _row(r: dict) -> list[str]:
    def rate(s: Summary) -> str:
        return f"{s.median:.0f}"

    def ratio(s: Summary) -> str:
        return f"{s.median:.2f} [{s.min:.2f}-{s.max:.2f}]"

    return [
        str(r["context"]),
        rate(r["prefill_tok_s"]),
        rate(r["hf_prefill_tok_s"]),
        ratio(r["prefill_vs_hf"]),
        rate(r["decode_tok_s"]),
        rate(r["hf_decode_tok_s"]),
        ratio(r["decode_vs_hf"]),
        f"{r['prefill_hit_s'].median:.3f} vs {r['prefill_cold_s'].median:.3f}",
        f"{r['hit_saved_fraction'].median:.0%}",
    ]
