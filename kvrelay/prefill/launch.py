"""`kvrelay launch prefill` (flags: `kvrelay.worker.launch`)."""

from __future__ import annotations

import argparse

from kvrelay.worker.launch import add_arguments, run

__all__ = ["add_arguments", "run_prefill"]


def run_prefill(args: argparse.Namespace) -> None:
    from kvrelay.prefill.worker import PrefillWorker

    run(PrefillWorker, args)
