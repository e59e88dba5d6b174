"""`kvrelay bench agentic-trace`: write `kvrelay demo`'s agentic workload as a
Mooncake-format trace for `kvrelay bench cache --trace`.

Sessions come from the demo's workload generator (`kvrelay.demo.workload`):
one system prompt shared by all, a task per session, then turns that append
the answer and a tool output and resend everything. At most `--concurrent`
sessions are live; turns go round robin over the live ones, and a session
that finishes hands its place to the next, so the trace mixes new sessions
(the shared prompt hit, their own pages cold) with long-running ones.
Answers are token ids drawn per (session, turn) from the workload's seed:
the trace is the same on every run.

Each line: `timestamp` (ms, the request's order), `input_length` (prompt
tokens), `output_length` (the answer's), `hash_ids`: one id per full
`--block-tokens` page of the prompt, from kvrelay's page key chain (the same
id for the same prefix page in any request), as Mooncake traces number
blocks.
"""

from __future__ import annotations

import argparse
import json
from collections import deque
from pathlib import Path

import numpy as np

from kvrelay.demo.workload import Session, WorkloadConfig
from kvrelay.layout.keys import page_keys

_ROOT = b"\0" * 32


def _answer(config: WorkloadConfig, session: int, turn: int) -> list[int]:
    seed = ((config.seed + 7) * 1_000_003 + session) * 1_000_003 + turn
    return np.random.default_rng(seed).integers(0, config.vocab, config.answer_tokens).tolist()


def agentic_requests(config: WorkloadConfig, concurrent: int, block_tokens: int) -> list[dict]:
    """The workload's turns in arrival order, as Mooncake trace records."""
    if concurrent < 1 or block_tokens < 1:
        raise ValueError("concurrent and block_tokens must be >= 1")
    waiting = deque(Session(i, config) for i in range(config.sessions))
    live: deque[Session] = deque()
    ids: dict[bytes, int] = {}
    records: list[dict] = []
    while waiting or live:
        while waiting and len(live) < concurrent:
            live.append(waiting.popleft())
        session = live.popleft()
        prompt = session.prompt()
        keys = page_keys(_ROOT, prompt, block_tokens)
        records.append({
            "timestamp": len(records),
            "input_length": len(prompt),
            "output_length": config.answer_tokens,
            "hash_ids": [ids.setdefault(k, len(ids)) for k in keys],
        })  # fmt: skip
        session.answered(_answer(config, session.index, session.turn))
        if not session.done:
            live.append(session)
    return records


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="the JSONL trace to write")
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--concurrent", type=int, default=8, help="sessions live at once")
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--system-tokens", type=int, default=8192)
    parser.add_argument("--user-tokens", type=int, default=512)
    parser.add_argument("--tool-tokens", type=int, default=1536)
    parser.add_argument("--answer-tokens", type=int, default=64)
    parser.add_argument("--block-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> list[dict]:
    config = WorkloadConfig(
        sessions=args.sessions, turns=args.turns, system_tokens=args.system_tokens,
        user_tokens=args.user_tokens, tool_tokens=args.tool_tokens,
        answer_tokens=args.answer_tokens, seed=args.seed,
    )  # fmt: skip
    records = agentic_requests(config, args.concurrent, args.block_tokens)
    path = Path(args.out)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    pages = len({i for r in records for i in r["hash_ids"]})
    print(f"{len(records)} requests, {pages} distinct pages -> {path}")
    return records
