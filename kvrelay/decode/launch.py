"""`kvrelay launch decode` (flags: `kvrelay.worker.launch`)."""

from __future__ import annotations

import argparse

from kvrelay.worker.launch import add_decode_arguments, run

__all__ = ["add_decode_arguments", "run_decode"]


def run_decode(args: argparse.Namespace) -> None:
    from kvrelay.decode.worker import DecodeWorker

    run(DecodeWorker, args)
