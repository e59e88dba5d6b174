"""Generated workloads of `kvrelay bench cache --workloads`: Mooncake-format
requests (`hash_ids` of full blocks) for shapes no public trace covers.

The two agentic ones are `kvrelay bench agentic-trace`'s (the demo's
sessions, tokenized and keyed for real); the rest are sessions of block ids
drawn directly, so that each isolates one thing an eviction policy can get
wrong: a session resends its whole prompt each turn (a system prompt, its
task, then `grow` new pages a turn), at most `concurrent` sessions are live
and take turns round robin, and a finished session hands its place to the
next. All are deterministic (a fixed seed).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

BLOCK = 512  # tokens per block: the bench's default --block-tokens


@dataclass(frozen=True)
class Shape:
    sessions: int = 64
    turns: int = 8
    concurrent: int = 8
    system_pages: tuple[int, ...] = (16,)  # session i uses prompt i % len(...)
    task_pages: int = 1
    grow: int = 3  # new pages per turn (an answer and a tool output)
    flood: int = 0  # one-off requests sent between a session's end and the next's start
    flood_pages: tuple[int, int] = (4, 16)  # their lengths, drawn in this range
    scan_every: int = 0  # a one-off scan after this many session requests
    scan_pages: int = 0


def sessions_trace(shape: Shape, seed: int = 0) -> list[dict]:
    """Requests of `shape`, in the order they are sent."""
    rng = np.random.default_rng(seed)
    ids = itertools.count()
    systems = [[next(ids) for _ in range(n)] for n in shape.system_pages]
    records: list[dict] = []

    def send(hash_ids: list[int]) -> None:
        records.append({"timestamp": len(records), "input_length": len(hash_ids) * BLOCK,
                        "output_length": 64, "hash_ids": list(hash_ids)})  # fmt: skip

    def one_off(pages: int) -> None:
        send([next(ids) for _ in range(pages)])

    def start(index: int) -> list[int]:
        system = systems[index % len(systems)]
        return [*system, *(next(ids) for _ in range(shape.task_pages))]

    live = [[i, start(i), 0] for i in range(min(shape.concurrent, shape.sessions))]
    started, sent = len(live), 0
    while live:
        for entry in list(live):
            _, prompt, turn = entry
            send(prompt)
            sent += 1
            if shape.scan_every and sent % shape.scan_every == 0:
                one_off(shape.scan_pages)
            prompt.extend(next(ids) for _ in range(shape.grow))
            entry[2] = turn + 1
            if entry[2] < shape.turns:
                continue
            live.remove(entry)
            low, high = shape.flood_pages
            for _ in range(shape.flood):
                one_off(int(rng.integers(low, high + 1)))
            if started < shape.sessions:
                live.append([started, start(started), 0])
                started += 1
    return records


def _agentic(jitter: float) -> Callable[[], list[dict]]:
    def make() -> list[dict]:
        from kvrelay.bench.agentic_trace import agentic_requests
        from kvrelay.demo.workload import WorkloadConfig

        config = WorkloadConfig(sessions=64, turns=12, tool_tokens=1536, answer_tokens=64,
                                user_tokens=512)  # fmt: skip
        return agentic_requests(config, 8, BLOCK, jitter)

    return make


def _shape(**fields) -> Callable[[], list[dict]]:
    return lambda: sessions_trace(Shape(**fields))


# name -> (what it is, for --help; its requests)
WORKLOADS: dict[str, tuple[str, Callable[[], list[dict]]]] = {
    "agentic": ("bench agentic-trace's default: 64 sessions of 12 turns, 8 live, round robin",
                _agentic(0.0)),
    "agentic-jitter": ("the same with --think-jitter 1.0: turns interleave irregularly",
                       _agentic(1.0)),
    "floods": ("sessions with a flood of 48 one-off requests (4-16 pages) between one"
               " session's end and the next's start", _shape(flood=48)),
    "scan": ("sessions with a one-off 600-page scan (more than every cache below the working"
             " set) after every 48 session requests", _shape(scan_every=48, scan_pages=600)),
    "short-sessions": ("256 sessions of 3 turns, 16 live", _shape(sessions=256, turns=3,
                                                                 concurrent=16)),
    "long-sessions": ("6 sessions of 64 turns, 3 live", _shape(sessions=6, turns=64,
                                                              concurrent=3)),
    "system-prompts": ("sessions over four shared system prompts of 2, 8, 24 and 64 pages",
                       _shape(system_pages=(2, 8, 24, 64))),
}  # fmt: skip


def workload_names(text: str) -> list[str]:
    """`--workloads`: comma-separated names, or `all`; ValueError naming the unknown."""
    names = list(WORKLOADS) if text == "all" else [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or not names:
        raise ValueError(f"unknown workloads {unknown}; known: all, {', '.join(WORKLOADS)}")
    return names


def help_text() -> str:
    lines = "; ".join(f"{name}: {what}" for name, (what, _) in WORKLOADS.items())
    return f"replay generated workloads (comma-separated, or all) against LRU. {lines}"
