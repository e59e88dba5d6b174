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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrelay", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="show the build: backends, versions")
    info.set_defaults(func=_info)

    from kvrelay.model import commands as model_commands

    generate = commands.add_parser("generate", help="generate tokens with the reference runner")
    model_commands.add_generate_arguments(generate)
    generate.set_defaults(func=model_commands.run_generate)
    make_model = commands.add_parser(
        "make-model", help="write a random Llama/Qwen2 model in HF format (config + safetensors)"
    )
    model_commands.add_make_model_arguments(make_model)
    make_model.set_defaults(func=model_commands.run_make_model)

    launch = commands.add_parser("launch", help="run a kvrelay server process")
    servers = launch.add_subparsers(dest="server", required=True)
    from kvrelay.cache import launch as cache_launch

    cache_parser = servers.add_parser("cache", help="a cache server (L2 arena, optional L3)")
    cache_launch.add_arguments(cache_parser)
    cache_parser.set_defaults(func=cache_launch.run)

    bench = commands.add_parser("bench", help="benchmarks: print a table, write JSON")
    benches = bench.add_subparsers(dest="bench", required=True)
    from kvrelay.bench import layout

    layout_parser = benches.add_parser(
        "layout", help="gather/scatter between a paged pool and unified pages vs memcpy"
    )
    layout.add_arguments(layout_parser)
    layout_parser.set_defaults(func=layout.run)
    from kvrelay.bench import model as model_bench

    model_parser = benches.add_parser(
        "model", help="prefill/decode tokens/s vs HF transformers; prefill saved by prefix reuse"
    )
    model_bench.add_arguments(model_parser)
    model_parser.set_defaults(func=model_bench.run)
    from kvrelay.bench import transfer

    transfer_parser = benches.add_parser("transfer", help="page pulls between two processes")
    transfer.add_arguments(transfer_parser)
    transfer_parser.set_defaults(func=transfer.run)
    from kvrelay.bench import cache as cache_bench

    cache_bench_parser = benches.add_parser(
        "cache", help="replay a Mooncake trace: shared tier vs local caches vs infinite"
    )
    cache_bench.add_arguments(cache_bench_parser)
    cache_bench_parser.set_defaults(func=cache_bench.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
