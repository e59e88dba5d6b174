"""argparse types for the bench commands' numeric flags.

A value out of range is a usage error that names the flag (argparse adds
it), given before any work starts, instead of a traceback from deep in a
replay or, worse, a run that quietly means something else (`--limit -3`
slicing off the trace's last three requests).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def at_least(minimum: int) -> Callable[[str], int]:
    """An integer >= `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
        return value

    return parse


def ints_at_least(minimum: int) -> Callable[[str], list[int]]:
    """A comma-separated list of integers, each >= `minimum`, at least one."""
    one = at_least(minimum)

    def parse(text: str) -> list[int]:
        try:  # an empty part ("8,,30") is no integer either
            return [one(part) for part in text.split(",")]
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"must be comma-separated integers >= {minimum}, got {text!r}"
            ) from None

    return parse


def non_negative_float(text: str) -> float:
    """A finite or infinite number >= 0 (nan refused)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value
