"""The `kvrelay` command."""

from __future__ import annotations

import argparse
import json
import sys


def _info(_: argparse.Namespace) -> None:
    from kvrelay.bench.stats import machine_info
    from kvrelay.cuda_ext import compiled_module

    module = compiled_module()
    info = machine_info() | {
        "compiled_module": getattr(module, "__file__", None),
        "compiled_with_cuda": bool(getattr(module, "with_cuda", False)),
    }
    print(json.dumps(info, indent=2))


def _subcommand(group, name: str, help_text: str, add_arguments, run) -> None:
    """One subcommand: its parser, its arguments (from the module that owns
    them), and the function that runs it."""
    parser = group.add_parser(name, help=help_text)
    add_arguments(parser)
    parser.set_defaults(func=run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrelay", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="show the build: backends, versions")
    info.set_defaults(func=_info)

    from kvrelay.model import commands as model

    _subcommand(commands, "generate", "generate tokens with the reference runner",
                model.add_generate_arguments, model.run_generate)  # fmt: skip
    _subcommand(commands, "make-model",
                "write a random Llama/Qwen2 model in HF format (config + safetensors)",
                model.add_make_model_arguments, model.run_make_model)  # fmt: skip

    from kvrelay.demo import command as demo

    _subcommand(commands, "demo",
                "a local cluster replaying an agentic multi-turn workload, per cache mode",
                demo.add_arguments, demo.run)  # fmt: skip

    launch = commands.add_parser("launch", help="run a kvrelay server process")
    servers = launch.add_subparsers(dest="server", required=True)
    from kvrelay.cache import launch as cache_launch

    _subcommand(servers, "cache", "a cache server (L2 arena, optional L3)",
                cache_launch.add_arguments, cache_launch.run)  # fmt: skip
    from kvrelay.decode import launch as decode_launch
    from kvrelay.prefill import launch as prefill_launch

    _subcommand(servers, "prefill", "a prefill worker (registers with control)",
                prefill_launch.add_arguments, prefill_launch.run_prefill)  # fmt: skip
    _subcommand(servers, "decode", "a decode worker (registers with control)",
                decode_launch.add_decode_arguments, decode_launch.run_decode)  # fmt: skip

    from kvrelay.control import launch as control_launch

    _subcommand(servers, "control", "the control endpoint (HTTP: completions, registry, admin)",
                control_launch.add_arguments, control_launch.run)  # fmt: skip

    _add_benches(commands)
    return parser


def _add_benches(commands) -> None:
    bench = commands.add_parser("bench", help="benchmarks: print a table, write JSON")
    benches = bench.add_subparsers(dest="bench", required=True)
    from kvrelay.bench import cache, layout, transfer
    from kvrelay.bench import cp as cp_bench
    from kvrelay.bench import model as model_bench
    from kvrelay.bench import scale as scale_bench
    from kvrelay.bench import sglang as sglang_bench
    from kvrelay.bench import spec as spec_bench
    from kvrelay.chaos import bench as chaos_bench

    for name, module, help_text in (
        ("layout", layout, "gather/scatter between a paged pool and unified pages vs memcpy"),
        ("model", model_bench,
         "prefill/decode tokens/s vs HF transformers; prefill saved by prefix reuse"),
        ("transfer", transfer, "page pulls between two processes"),
        ("cache", cache, "replay a Mooncake trace: shared tier vs local caches vs infinite"),
        ("chaos", chaos_bench, "faults, hostile input and load against a real local cluster"),
        ("cp", cp_bench, "prefill time of a long prompt at CP=1 vs CP=2, in one run"),
        ("spec", spec_bench,
         "decode tokens/s with and without MTP speculation, acceptance; CP prefill"),
        ("sglang", sglang_bench,
         "pages/s and GB/s of kvrelay's SGLang HiCache backend vs SGLang's HiCacheFile"),
        ("scale", scale_bench,
         "per-phase time and memory of a request against its cached context, vs the floor"),
    ):  # fmt: skip
        _subcommand(benches, name, help_text, module.add_arguments, module.run)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
