"""Drive the workload's sessions through the control endpoint, concurrently.

Each session sends its turns one after another (a turn needs the previous
answer); all sessions run at once. Requests stream (`stream: true`), so
time to first token and the gaps between tokens are measured here, at the
client, from the moment the request is sent.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from kvrelay.demo.workload import Session, WorkloadConfig


@dataclass(slots=True)
class TurnRecord:
    session: int
    turn: int
    prompt_tokens: int
    tokens: list[int] = field(default_factory=list)
    ttft_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)  # per generated token after the first
    total_s: float = 0.0
    cached_local: int = 0
    cached_tier: int = 0
    prefill_timings: dict = field(default_factory=dict)  # the prefill worker's breakdown
    control_ttft_s: float = 0.0  # TTFT as control measured it
    decode_first_s: float | None = None  # decode request -> its first token batch
    finish_reason: str | None = None
    error: str | None = None


class ReplayError(RuntimeError):
    pass


async def _one_turn(client: httpx.AsyncClient, url: str, record: TurnRecord, body: dict) -> None:
    start = time.perf_counter()
    last = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            raise ReplayError(f"HTTP {response.status_code}: {text[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                raise ReplayError(f"stream error: {chunk['error']}")
            now = time.perf_counter()
            choice = (chunk.get("choices") or [{}])[0]
            ids = choice.get("token_ids") or []
            if ids:
                if not record.tokens:
                    record.ttft_s = now - start
                    # Tokens that arrive together share the gap since the last arrival.
                    rest = len(ids) - 1
                    record.gaps_s.extend([0.0] * rest)
                else:
                    record.gaps_s.extend([(now - last) / len(ids)] * len(ids))
                record.tokens.extend(ids)
                last = now
            if choice.get("finish_reason"):
                record.finish_reason = choice["finish_reason"]
            info = chunk.get("kvrelay") or {}
            record.prefill_timings = info.get("prefill_timings") or record.prefill_timings
            record.control_ttft_s = info.get("ttft_s") or record.control_ttft_s
            record.decode_first_s = info.get("decode_first_s") or record.decode_first_s
            cached = info.get("cached_tokens")
            if cached:
                record.cached_local = int(cached.get("local", 0))
                record.cached_tier = int(cached.get("tier", 0))
    record.total_s = time.perf_counter() - start


async def _timed_turn(client, url: str, config: WorkloadConfig, session: Session,
                      timeout_s: float) -> TurnRecord:  # fmt: skip
    """The session's next turn, streamed within `timeout_s`; a failure is the
    record's `error`, not an exception."""
    prompt = session.prompt()
    record = TurnRecord(session.index, session.turn, len(prompt))
    body = {"prompt": prompt, "max_tokens": config.answer_tokens, "temperature": 0.0,
            "stream": True}  # fmt: skip
    try:
        async with asyncio.timeout(timeout_s):
            await _one_turn(client, url, record, body)
    except (ReplayError, httpx.HTTPError, TimeoutError) as error:
        record.error = f"{type(error).__name__}: {error}"
    return record


async def replay(
    url: str,
    config: WorkloadConfig,
    *,
    turns: range | None = None,
    sessions: list[Session] | None = None,
    timeout_s: float = 600.0,
    progress=None,
) -> tuple[list[TurnRecord], list[Session]]:
    """Runs `turns` (default: all) of every session; returns the records in
    completion order and the sessions (to continue them later)."""
    sessions = sessions or [Session(i, config) for i in range(config.sessions)]
    turns = turns or range(config.turns)
    records: list[TurnRecord] = []

    async def run_session(session: Session, client: httpx.AsyncClient) -> None:
        while session.turn < turns.stop and not session.done:
            record = await _timed_turn(client, url, config, session, timeout_s)
            records.append(record)
            if progress is not None:
                progress.update(1)
            if record.error:
                return  # the conversation cannot go on without its answer
            session.answered(record.tokens)

    limits = httpx.Limits(max_connections=len(sessions) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        await asyncio.gather(*(run_session(s, client) for s in sessions))
    return records, sessions


def sample_turns(config: WorkloadConfig, count: int) -> list[tuple[int, int]]:
    """`count` (session, turn) pairs spread evenly from the first turn to the
    last, sessions taken in turn."""
    if count <= 1:
        return [(0, config.turns - 1)][:count]
    step = (config.turns - 1) / (count - 1)
    return [(i % config.sessions, round(i * step)) for i in range(count)]


async def replay_sample(
    url: str,
    config: WorkloadConfig,
    reference: list[TurnRecord],
    picks: list[tuple[int, int]],
    *,
    timeout_s: float = 600.0,
    progress=None,
) -> list[TurnRecord]:
    """Only the turns `picks`, one at a time, each with the prompt the
    reference run sent (its answers rebuild the conversation): a mode too
    slow to run the whole workload (no cache at 200K tokens on a CPU) is
    measured on the same prompts."""
    answers = {(r.session, r.turn): r.tokens for r in reference if r.error is None}
    records = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s)) as client:
        for index, turn in picks:
            session = Session(index, config)
            for earlier in range(turn):
                if (index, earlier) not in answers:
                    raise ReplayError(f"the reference has no session {index} turn {earlier + 1}")
                session.answered(answers[index, earlier])
            record = await _timed_turn(client, url, config, session, timeout_s)
            records.append(record)
            if progress is not None:
                progress.update(1)
    return records
