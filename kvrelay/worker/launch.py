"""`kvrelay launch prefill` and `kvrelay launch decode`: run one worker until
SIGTERM or SIGINT (see docs/serving-protocol.md for the flags)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os


def _default_backend() -> str:
    try:
        import kvrelay._ucx  # noqa: F401
    except ImportError:
        return "tcp"
    return "ucx"


def add_arguments(parser: argparse.ArgumentParser, *, decode: bool = False) -> None:
    parser.add_argument("--model", required=True, help="model directory (HF format)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1,
                        help="context-parallel prefill ranks (prefill only)")  # fmt: skip
    parser.add_argument("--control", default="", help="control's URL (registration)")
    parser.add_argument(
        "--token", default=os.environ.get("KVRELAY_TOKEN"), help="cluster token ($KVRELAY_TOKEN)"
    )
    parser.add_argument("--cache", default="", help="cache servers H:P[,H:P...]")
    parser.add_argument("--backend", default=None, choices=["ucx", "tcp"],
                        help="transfer backend (default: ucx when built, else tcp)")  # fmt: skip
    parser.add_argument("--listen", default="127.0.0.1:0", help="msgpack listener HOST:PORT")
    parser.add_argument("--num-pages", type=int, default=256, help="KV pool pages per rank")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu",
                        help="cpu, cuda or cuda:N: the first rank's device; rank r on "
                        "cuda:N+r, or all on one GPU when one is visible")  # fmt: skip
    # The choices are kvrelay.model.device.STAGING_KINDS, not imported here:
    # parsing the command line must not load torch.
    parser.add_argument("--staging", default="pinned", choices=["device", "pinned"],
                        help="GPU pools: staging in host memory via pinned buffers (pinned, "
                        "the default) or in GPU memory (device; ucx only)")  # fmt: skip
    parser.add_argument("--no-local-cache", action="store_true",
                        help="no prefix reuse from the worker's own pool")  # fmt: skip
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--max-queue", type=int, default=64)
    parser.add_argument("--staging-pages", type=int, default=0,
                        help="rows of each rank's staging arena (default --num-pages)")  # fmt: skip
    parser.add_argument("--transfer-timeout-s", type=float, default=10.0)
    parser.add_argument("--hello-timeout-s", type=float, default=10.0,
                        help="deadline of a connection's hello and request")  # fmt: skip
    if decode:
        parser.add_argument("--write-back", action="store_true",
                            help="write finished sequences' full pages to the tier")  # fmt: skip
        parser.add_argument("--speculative", type=int, default=0, metavar="K",
                            help="draft K tokens per step with the model's MTP layer")  # fmt: skip


def add_decode_arguments(parser: argparse.ArgumentParser) -> None:
    add_arguments(parser, decode=True)


def _config(args: argparse.Namespace, role: str):
    from kvrelay.model.device import DeviceError, parse_device
    from kvrelay.worker.front import WorkerConfig

    if not args.token:
        raise SystemExit("kvrelay launch: give --token or set KVRELAY_TOKEN")
    if role == "decode" and args.cp != 1:
        raise SystemExit(
            "kvrelay launch decode: --cp is not supported on decode (decode runs CP=1; "
            "it reads pages written by a prefill of any --cp)"
        )
    if getattr(args, "speculative", 0) < 0:
        raise SystemExit("kvrelay launch: --speculative must be >= 0")
    for name in ("tp", "pp", "cp", "num_pages", "page_size", "max_batch", "max_queue"):
        if getattr(args, name) < 1:
            raise SystemExit(f"kvrelay launch: --{name.replace('_', '-')} must be >= 1")
    backend = args.backend or _default_backend()
    try:
        device = parse_device(args.device)
    except DeviceError as exc:
        raise SystemExit(f"kvrelay launch: {exc}") from None
    staging = args.staging
    if device.type == "cuda" and staging == "device" and backend != "ucx":
        raise SystemExit(
            f"kvrelay launch: --staging device puts staging in GPU memory, which only the ucx "
            f"backend moves; use --backend ucx or --staging pinned (not --backend {backend})"
        )
    return WorkerConfig(
        model_dir=args.model,
        token=args.token,
        tp=args.tp,
        pp=args.pp,
        cp=args.cp,
        control=args.control,
        cache=tuple(a for a in args.cache.split(",") if a),
        backend=backend,
        device=str(device),
        staging=staging,
        listen=args.listen,
        num_pages=args.num_pages,
        page_size=args.page_size,
        dtype=args.dtype,
        local_cache=not args.no_local_cache,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        write_back=getattr(args, "write_back", False),
        staging_pages=args.staging_pages,
        transfer_timeout_s=args.transfer_timeout_s,
        hello_timeout_s=args.hello_timeout_s,
        speculative=getattr(args, "speculative", 0),
    )


def _run(role: str, args: argparse.Namespace) -> None:
    from kvrelay.worker.front import serve_until_signal

    if role == "prefill":
        from kvrelay.prefill.worker import PrefillWorker as Worker
    else:
        from kvrelay.decode.worker import DecodeWorker as Worker
    logging.basicConfig(level=logging.WARNING)
    config = _config(args, role)
    try:
        asyncio.run(serve_until_signal(Worker(config)))
    except (ValueError, OSError) as exc:  # a bad model or config, a busy --listen
        raise SystemExit(f"kvrelay launch {role}: {exc}") from None


def run_prefill(args: argparse.Namespace) -> None:
    _run("prefill", args)


def run_decode(args: argparse.Namespace) -> None:
    _run("decode", args)
