"""`kvrelay generate` and `kvrelay make-model`: argument parsing and running.

kvrelay/cli.py only wires these to subcommands.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvrelay.layout import DEFAULT_PAGE_SIZE, LayoutError, ParallelConfig
from kvrelay.model.config import TORCH_DTYPES
from kvrelay.model.cross_config import open_runner, parse_parallel, prefix_unified_pages
from kvrelay.model.engine import DEFAULT_MAX_PREFILL_TOKENS, Request
from kvrelay.model.errors import ModelLoadError, PoolExhausted, RequestError
from kvrelay.model.loader import load_config
from kvrelay.model.make_mla_model import MLA_ARCHS, add_mla_arguments, mla_spec_of, write_mla_model
from kvrelay.model.make_model import add_shape_arguments, shape_spec, write_model
from kvrelay.model.sampling import SamplingParams


def _ids(text: str) -> list[int]:
    """Token ids separated by commas and/or whitespace (a JSON list too)."""
    try:
        return [int(t) for t in text.strip().strip("[]").replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token ids, got {text[:60]!r}"
        ) from None


def _ids_file(path: str) -> list[int]:
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot read token ids from {path}: {error}") from None
    return _ids(text)


def _prompt_ids(text: str) -> list[int]:
    # A long prompt (64K ids) does not fit the argument list: @path reads a file.
    return _ids_file(text[1:]) if text.startswith("@") else _ids(text)


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="Hugging Face model directory")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt-ids", type=_prompt_ids, help="e.g. 1,2,3, or @FILE")
    prompt.add_argument(
        "--prompt-ids-file",
        type=_ids_file,
        metavar="FILE",
        help="token ids separated by commas or whitespace",
    )
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default="float32")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1, help="context-parallel prefill ranks")
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu, cuda or cuda:N (the first rank's; rank r on cuda:N+r, or all on one GPU)",
    )
    parser.add_argument(
        "--reuse-prefix",
        type=int,
        default=0,
        metavar="K",
        help="run and cache the first K prompt tokens first; the full prompt reuses their pages",
    )
    parser.add_argument(
        "--prefix-parallel",
        type=parse_parallel,
        default=None,
        metavar="tp=T,pp=P,cp=C",
        help="compute the --reuse-prefix pages under this parallel config, then import them",
    )
    parser.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE)
    parser.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=DEFAULT_MAX_PREFILL_TOKENS,
        help="new tokens per prefill forward (chunked prefill bounds memory)",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--stop-ids", type=_ids, default=None, help="stop tokens (default: the config's EOS)"
    )
    parser.add_argument(
        "--speculative",
        type=int,
        default=0,
        metavar="K",
        help="draft K tokens per step with the model's MTP layer (0: off)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help='print {"tokens": [...]} only (and "spec": {proposed, accepted, steps} with K > 0)',
    )


def run_generate(args: argparse.Namespace) -> dict:
    try:
        return _generate(args)
    except (ModelLoadError, RequestError, PoolExhausted, LayoutError) as error:
        # Bad input is a one-line message naming what is wrong, not a traceback.
        raise SystemExit(f"kvrelay generate: {error}") from None


def _generate(args: argparse.Namespace) -> dict:
    prompt = args.prompt_ids if args.prompt_ids is not None else args.prompt_ids_file
    if not prompt:
        raise SystemExit("--prompt-ids is empty")
    if not 0 <= args.reuse_prefix <= len(prompt):
        raise SystemExit(f"--reuse-prefix must lie in [0, {len(prompt)}]")
    if args.speculative < 0:
        raise SystemExit("--speculative must be >= 0")
    config = load_config(args.model)
    stops = config.eos_token_ids if args.stop_ids is None else tuple(args.stop_ids)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_token_ids=stops,
    )
    if args.prefix_parallel is not None and not args.reuse_prefix:
        raise SystemExit("--prefix-parallel needs --reuse-prefix K > 0")
    if args.max_prefill_tokens <= 0:
        raise SystemExit("--max-prefill-tokens must be positive")
    sizes = ParallelConfig(tp=args.tp, pp=args.pp, cp=args.cp)
    # Room for both runs even if nothing were shared.
    pages = 2 * (-(-(len(prompt) + args.max_new_tokens) // args.page_size)) + 1
    options = {
        "dtype": args.dtype,
        "page_size": args.page_size,
        "num_pages": pages,
        "device": args.device,
        "max_prefill_tokens": args.max_prefill_tokens,
    }
    if args.speculative:
        options["speculative"] = args.speculative
    prefix, imported = prompt[: args.reuse_prefix], None
    if prefix and args.prefix_parallel is not None:
        # The prefix's pages (target and draft) from another config: they
        # must serve this one as is.
        imported = prefix_unified_pages(args.model, args.prefix_parallel, prefix, **options)
    with open_runner(args.model, sizes, **options) as runner:
        if imported is not None:
            runner.import_prefix(prefix, imported[0])
            if imported[1] is not None:
                runner.import_draft_prefix(prefix, imported[1])
        elif prefix:
            runner.generate([Request(prefix, SamplingParams(1))])
        result = runner.generate([Request(prompt, params)])[0]
    _print_result(result, args.json)
    return {"tokens": result.tokens, "cached_tokens": result.cached_tokens, "spec": result.spec}


def _print_result(result, as_json: bool) -> None:
    if as_json:
        line = {"tokens": result.tokens}
        if result.spec is not None:
            line["spec"] = result.spec
        print(json.dumps(line))
    else:
        print(
            f"generated {len(result.tokens)} tokens ({result.finish_reason}), "
            f"{result.cached_tokens} prompt tokens from cached pages:",
            file=sys.stderr,
        )
        print(" ".join(str(t) for t in result.tokens))
        if result.spec is not None:
            stats = result.spec
            rate = stats["accepted"] / stats["proposed"] if stats["proposed"] else 0.0
            print(
                f"speculative: {stats['proposed']} proposed, {stats['accepted']} accepted "
                f"({rate:.1%}) over {stats['steps']} steps",
                file=sys.stderr,
            )


def add_make_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", choices=["llama", "qwen2", *MLA_ARCHS], required=True)
    add_shape_arguments(parser)
    add_mla_arguments(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--intermediate", type=int, help="MLP width (default 2 x hidden)")
    parser.add_argument("--head-dim", type=int, help="default hidden / heads")
    parser.add_argument("--tie-embeddings", action="store_true")
    parser.add_argument("--attention-bias", action="store_true", help="Llama: q/k/v/o biases")
    parser.add_argument("--mlp-bias", action="store_true", help="Llama: MLP biases")
    parser.add_argument("--rope-theta", type=float, default=10000.0)
    parser.add_argument("--max-positions", type=int, default=16384,
                        help="max_position_embeddings")  # fmt: skip
    parser.add_argument("--std", type=float, default=0.05, help="weight init std")
    parser.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default="float32")
    parser.add_argument("--shards", type=int, default=1, help="safetensors files (indexed)")
    parser.add_argument(
        "--mtp", type=int, choices=[0, 1], default=0, help="DeepSeek-V3 style MTP layers"
    )
    parser.add_argument(
        "--mtp-init",
        choices=["random", "copy"],
        default="random",
        help="copy: build the MTP layer from the target's first layer (a draft that agrees "
        "with a one-layer target on new prompts)",
    )
    parser.add_argument(
        "--mtp-fit-steps",
        type=int,
        default=0,
        help="fit the MTP layer to the target's greedy continuations for N Adam steps",
    )
    parser.add_argument("dir", help="output directory")


def run_make_model(args: argparse.Namespace) -> None:
    if args.arch in MLA_ARCHS:
        if args.mtp_fit_steps:
            raise SystemExit("--mtp-fit-steps is for llama and qwen2")
        spec = mla_spec_of(args)
        try:
            path = write_mla_model(args.dir, spec)
        except ValueError as bad:
            raise SystemExit(str(bad)) from None
        print(f"wrote {spec.arch} model ({spec.layers} layers, hidden {spec.hidden}) to {path}")
        return
    spec = shape_spec(
        args,
        arch=args.arch,
        intermediate=args.intermediate,
        head_dim=args.head_dim,
        tie_embeddings=args.tie_embeddings,
        attention_bias=args.attention_bias,
        mlp_bias=args.mlp_bias,
        rope_theta=args.rope_theta,
        max_positions=args.max_positions,
        std=args.std,
        seed=args.seed,
        dtype=args.dtype,
        shards=args.shards,
        mtp=args.mtp,
        mtp_init=args.mtp_init,
    )
    if args.mtp_fit_steps and not args.mtp:
        raise SystemExit("--mtp-fit-steps needs --mtp 1")
    try:
        path = write_model(args.dir, spec)
    except ValueError as bad:
        raise SystemExit(str(bad)) from None
    print(f"wrote {spec.arch} model ({spec.layers} layers, hidden {spec.hidden}) to {path}")
    if args.mtp_fit_steps:
        from kvrelay.model.mtp_fit import fit_mtp

        fitted = fit_mtp(path, args.mtp_fit_steps)
        print(
            f"fitted the MTP layer for {args.mtp_fit_steps} steps: agreement with the target "
            f"{fitted['agreement_before']:.1%} -> {fitted['agreement_after']:.1%} (fitting data)"
        )
