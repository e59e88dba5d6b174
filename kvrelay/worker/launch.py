"""`kvrelay launch prefill` and `kvrelay launch decode`: run one worker until
SIGTERM or SIGINT. The flags are generated from `WorkerConfig`
(docs/serving-protocol.md lists them)."""

from __future__ import annotations

import argparse
import asyncio
import logging

from kvrelay import options
from kvrelay.worker.config import WorkerConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_arguments(parser, WorkerConfig, skip=("write_back",))


def add_decode_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_arguments(parser, WorkerConfig)


def run(worker_class, args: argparse.Namespace) -> None:
    """Runs `worker_class` (a `WorkerFront`) with the config of `args`."""
    from kvrelay.worker.front import serve_until_signal

    logging.basicConfig(level=logging.WARNING)
    config = options.from_args(WorkerConfig, args).checked(worker_class.role)
    try:
        asyncio.run(serve_until_signal(worker_class(config)))
    except (ValueError, OSError) as exc:  # a bad model or config, a busy --listen
        raise SystemExit(f"kvrelay launch {worker_class.role}: {exc}") from None
