"""The `kvrelay` command."""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys
import threading


def _info(_: argparse.Namespace) -> None:
    from kvrelay.bench.stats import machine_info
    from kvrelay.cuda_ext import compiled_module
    from kvrelay.transfer.calibrate import copy_plan
    from kvrelay.transfer.stripes import stripe_choice

    module = compiled_module()
    plan = copy_plan()
    info = machine_info() | {
        "compiled_module": getattr(module, "__file__", None),
        "compiled_with_cuda": bool(getattr(module, "with_cuda", False)),
        # The same-host fast path's copy as this host measured it (cached per boot).
        "fast_path_copy": plan.to_json(),
        # What a large pull is split over by default, from the same calibration.
        "pull_stripes": stripe_choice(plan),
    }
    print(json.dumps(info, indent=2))


# Every subcommand: its path, help, and the module (and the names in it) that
# owns its arguments and runs it. Only the chosen one is imported: a server
# process (`kvrelay launch cache`, started many times by a cluster and by the
# tests) does not pay for importing the control app, the demo and every bench.
_COMMANDS = (
    (("generate",), "generate tokens with the reference runner",
     "kvrelay.model.commands", "add_generate_arguments", "run_generate"),
    (("make-model",), "write a random Llama/Qwen2/GLM-5/DeepSeek model (HF config + safetensors)",
     "kvrelay.model.commands", "add_make_model_arguments", "run_make_model"),
    (("demo",), "a local cluster replaying an agentic multi-turn workload, per cache mode",
     "kvrelay.demo.command", "add_arguments", "run"),
    (("namespaces",), "cache servers' namespaces: the identity fields each was made from, pages",
     "kvrelay.cache.identities", "add_arguments", "run"),
    (("tenant-token",), "print the token that lets a client touch one namespace only",
     "kvrelay.cache.tenants", "add_token_arguments", "run_token"),
    (("launch", "cache"), "a cache server (L2 arena, optional L3)",
     "kvrelay.cache.launch", "add_arguments", "run"),
    (("launch", "prefill"), "a prefill worker (registers with control)",
     "kvrelay.prefill.launch", "add_arguments", "run_prefill"),
    (("launch", "decode"), "a decode worker (registers with control)",
     "kvrelay.decode.launch", "add_decode_arguments", "run_decode"),
    (("launch", "control"), "the control endpoint (HTTP: completions, registry, admin)",
     "kvrelay.control.launch", "add_arguments", "run"),
    (("bench", "layout"), "gather/scatter between a paged pool and unified pages vs memcpy",
     "kvrelay.bench.layout", "add_arguments", "run"),
    (("bench", "model"),
     "prefill/decode tokens/s vs HF transformers; prefill saved by prefix reuse",
     "kvrelay.bench.model", "add_arguments", "run"),
    (("bench", "transfer"), "page pulls between two processes",
     "kvrelay.bench.transfer", "add_arguments", "run"),
    (("bench", "cache"), "replay a Mooncake trace: eviction policies, Belady, local caches",
     "kvrelay.bench.cache", "add_arguments", "run"),
    (("bench", "agentic-trace"),
     "write kvrelay demo's agentic workload as a Mooncake trace (for bench cache --trace)",
     "kvrelay.bench.agentic_trace", "add_arguments", "run"),
    (("bench", "chaos"), "faults, hostile input and load against a real local cluster",
     "kvrelay.chaos.bench", "add_arguments", "run"),
    (("bench", "cp"), "prefill time of a long prompt at CP=1 vs CP=2, in one run",
     "kvrelay.bench.cp", "add_arguments", "run"),
    (("bench", "spec"), "decode tokens/s with and without MTP speculation, acceptance; CP prefill",
     "kvrelay.bench.spec", "add_arguments", "run"),
    (("bench", "sglang"),
     "pages/s and GB/s of kvrelay's SGLang HiCache backend vs SGLang's HiCacheFile",
     "kvrelay.bench.sglang", "add_arguments", "run"),
    (("bench", "sglang-server"),
     "real SGLang servers on an agentic replay: kvrelay L3 vs SGLang's file L3 vs none",
     "kvrelay.bench.sglang_server", "add_arguments", "run"),
    (("bench", "vllm"),
     "real vLLM engines: P/D handoff with KvrelayConnector vs NixlConnector; reuse via the tier",
     "kvrelay.bench.vllm", "add_arguments", "run"),
    (("bench", "scale"),
     "per-phase time and memory of a request against its cached context, vs the floor",
     "kvrelay.bench.scale", "add_arguments", "run"),
    (("bench", "long-request"),
     "one 1M-token request through a local cluster (context from the tier) vs one process",
     "kvrelay.bench.long_request", "add_arguments", "run"),
)  # fmt: skip
_GROUPS = {"launch": "run a kvrelay server process",
           "bench": "benchmarks: print a table, write JSON"}  # fmt: skip


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line; given the arguments about to be parsed, only the
    chosen subcommand's module is imported (the others get their help line)."""
    parser = argparse.ArgumentParser(prog="kvrelay", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="show the build: backends, versions")
    info.set_defaults(func=_info)
    groups = {}
    for path, help_text, module_name, add_arguments, run in _COMMANDS:
        group = commands
        if len(path) == 2:
            if path[0] not in groups:
                parent = commands.add_parser(path[0], help=_GROUPS[path[0]])
                dest = "server" if path[0] == "launch" else path[0]
                groups[path[0]] = parent.add_subparsers(dest=dest, required=True)
            group = groups[path[0]]
        sub = group.add_parser(path[-1], help=help_text)
        if argv is None or tuple(argv[: len(path)]) == path:
            module = importlib.import_module(module_name)
            getattr(module, add_arguments)(sub)
            sub.set_defaults(func=getattr(module, run))
    return parser


def _exit_on_sigterm(signum, _frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    if args.command != "bench" or threading.current_thread() is not threading.main_thread():
        args.func(args)
        return 0
    # SIGTERM unwinds like SIGINT's KeyboardInterrupt: the servers a bench
    # started (an L3 cluster, cache servers) stop in its `finally` blocks, as
    # on a normal exit, where the default action would leave them running.
    before = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        args.func(args)
    finally:
        signal.signal(signal.SIGTERM, before)
    return 0


if __name__ == "__main__":
    sys.exit(main())
