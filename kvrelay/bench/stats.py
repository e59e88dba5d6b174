"""Timing helpers shared by the benchmarks: repeated runs, median and spread, tables."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Summary:
    """Median and spread of repeated measurements of one quantity."""

    median: float
    min: float
    max: float
    runs: tuple[float, ...]

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary:
        return cls(statistics.median(values), min(values), max(values), tuple(values))

    @property
    def spread(self) -> float:
        """(max - min) / median: the relative width of the runs."""
        return (self.max - self.min) / self.median if self.median else 0.0

    def to_json(self) -> dict:
        return {**asdict(self), "spread": self.spread}


def time_once(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def machine_info() -> dict:
    import torch

    from kvrelay.cuda_ext import BACKEND_NAME

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "page_copy_backend": BACKEND_NAME,
    }


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: str | os.PathLike, payload: dict) -> None:
    Path(path).write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")


def write_report(args, benchmark: str, result: dict) -> None:
    """With `--json`: the benchmark's name, the machine and the arguments
    (less the command's function), then `result`'s fields."""
    if args.json:
        plain = {k: v for k, v in vars(args).items() if k != "func"}
        write_json(args.json, {"benchmark": benchmark, "machine": machine_info(), "args": plain}
                   | result)  # fmt: skip
