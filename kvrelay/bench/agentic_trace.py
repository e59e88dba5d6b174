"""`kvrelay bench agentic-trace`: write `kvrelay demo`'s agentic workload as a
Mooncake-format trace for `kvrelay bench cache --trace`.

Sessions come from the demo's workload generator (`kvrelay.demo.workload`):
one system prompt shared by all, a task per session, then turns that append
the answer and a tool output and resend everything. At most `--concurrent`
sessions are live, and a session that finishes hands its place to the next,
so the trace mixes new sessions (the shared prompt hit, their own pages
cold) with long-running ones.

Each session is a closed loop, as an agent is: its next turn is sent one
think time (the model's answer and the tool's run) after its last. With
`--think-jitter 0` every think time is `--concurrent` ms: the live sessions
take turns round robin, one request a millisecond while `--concurrent` are
live. A real agent's tool runs
vary (a file read against a test suite), so `--think-jitter SIGMA` draws
each think time from a lognormal of that sigma around the same median: the
turns of the live sessions interleave irregularly, and a session may come
back after many of the others' turns or before any. Answers and think times
are drawn per (session, turn) from the workload's seed: the trace is the
same on every run.

Each line: `timestamp` (ms, when the request is sent), `input_length` (prompt
tokens), `output_length` (the answer's), `hash_ids`: one id per full
`--block-tokens` page of the prompt, from kvrelay's page key chain (the same
id for the same prefix page in any request), as Mooncake traces number
blocks.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
from pathlib import Path

import numpy as np

from kvrelay.bench.arg_types import at_least, non_negative_float
from kvrelay.demo.workload import Session, WorkloadConfig
from kvrelay.layout.keys import page_keys

_ROOT = b"\0" * 32


def _answer(config: WorkloadConfig, session: int, turn: int) -> list[int]:
    seed = ((config.seed + 7) * 1_000_003 + session) * 1_000_003 + turn
    return np.random.default_rng(seed).integers(0, config.vocab, config.answer_tokens).tolist()


def _think_ms(config: WorkloadConfig, concurrent: int, jitter: float, session: int, turn: int):
    """The think time after a session's turn, in ms: until its next turn, or
    after its last turn until the first turn of the session taking its place."""
    if jitter == 0:
        return float(concurrent)
    rng = np.random.default_rng([config.seed, 11, session, turn])
    return concurrent * math.exp(jitter * rng.standard_normal())


def agentic_requests(
    config: WorkloadConfig, concurrent: int, block_tokens: int, think_jitter: float = 0.0
) -> list[dict]:
    """The workload's turns in the order they are sent, as Mooncake trace records."""
    if concurrent < 1 or block_tokens < 1:
        raise ValueError("concurrent and block_tokens must be >= 1")
    if not think_jitter >= 0:
        raise ValueError(f"think_jitter must be >= 0, got {think_jitter}")
    sessions = [Session(i, config) for i in range(config.sessions)]
    # (when its next turn is sent, tie-break, session): the first `concurrent`
    # sessions start a millisecond apart, the rest when a place frees.
    due = [(float(i), i, i) for i in range(min(concurrent, len(sessions)))]
    started = len(due)
    ids: dict[bytes, int] = {}
    records: list[dict] = []
    while due:
        at, _, index = heapq.heappop(due)
        session = sessions[index]
        prompt = session.prompt()
        keys = page_keys(_ROOT, prompt, block_tokens)
        records.append({
            "timestamp": round(at),
            "input_length": len(prompt),
            "output_length": config.answer_tokens,
            "hash_ids": [ids.setdefault(k, len(ids)) for k in keys],
        })  # fmt: skip
        think = _think_ms(config, concurrent, think_jitter, index, session.turn)
        session.answered(_answer(config, session.index, session.turn))
        if not session.done:
            heapq.heappush(due, (at + think, len(records), index))
        elif started < len(sessions):
            heapq.heappush(due, (at + think, len(records), started))
            started += 1
    return records


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="the JSONL trace to write")
    positive, non_negative = at_least(1), at_least(0)
    parser.add_argument("--sessions", type=positive, default=64)
    parser.add_argument("--concurrent", type=positive, default=8, help="sessions live at once")
    parser.add_argument("--turns", type=positive, default=12)
    parser.add_argument("--system-tokens", type=positive, default=8192)
    parser.add_argument("--user-tokens", type=non_negative, default=512)
    parser.add_argument("--tool-tokens", type=non_negative, default=1536)
    parser.add_argument("--answer-tokens", type=positive, default=64)
    parser.add_argument("--block-tokens", type=positive, default=512)
    parser.add_argument(
        "--think-jitter", type=non_negative_float, default=0.0, metavar="SIGMA",
        help="lognormal sigma of each session's think time between turns (0: round robin)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> list[dict]:
    config = WorkloadConfig(
        sessions=args.sessions, turns=args.turns, system_tokens=args.system_tokens,
        user_tokens=args.user_tokens, tool_tokens=args.tool_tokens,
        answer_tokens=args.answer_tokens, seed=args.seed,
    )  # fmt: skip
    records = agentic_requests(config, args.concurrent, args.block_tokens, args.think_jitter)
    path = Path(args.out)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    pages = len({i for r in records for i in r["hash_ids"]})
    print(f"{len(records)} requests, {pages} distinct pages -> {path}")
    return records
