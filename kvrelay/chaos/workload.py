"""The multi-session workload a fault runs under, and its oracle.

Sessions send greedy `/v1/completions` with token prompts (turns of one
session share a prefix, so the tier and the pools' caches are exercised);
every answer is checked against one process generating the same prompt
(`load_engine`, same weights, dtype and page size). Each request ends in one
class: correct, wrong tokens, a clear error (an HTTP error status with a
JSON reason within the deadline), lost (the connection dropped without an
answer) or hung (no answer within its deadline plus a margin)."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import dataclass, field

import httpx

CORRECT, WRONG, ERROR, LOST, HUNG = "correct", "wrong_tokens", "error", "lost", "hung"


@dataclass(slots=True)
class Outcome:
    kind: str
    status: int = 0
    latency_s: float = 0.0
    ttft_s: float = 0.0
    reason: str = ""


class Oracle:
    """Greedy tokens of one process for a prompt (memoised)."""

    def __init__(self, model_dir, dtype: str, page_size: int) -> None:
        from kvrelay.model import load_engine

        self.engine = load_engine(model_dir, dtype=dtype, page_size=page_size, num_pages=512)
        self._memo: dict[tuple, list[int]] = {}
        self._lock = threading.Lock()  # one engine, called from worker threads

    def tokens(self, prompt: list[int], max_tokens: int) -> list[int]:
        from kvrelay.model import Request, SamplingParams

        key = (tuple(prompt), max_tokens)
        with self._lock:
            if key not in self._memo:
                self.engine.pool.clear_cache()
                request = Request(list(prompt), SamplingParams(max_new_tokens=max_tokens))
                self._memo[key] = self.engine.generate([request])[0].tokens
            return self._memo[key]


@dataclass(slots=True)
class Workload:
    control_url: str
    oracle: Oracle
    vocab: int = 256
    max_tokens: int = 6
    deadline_s: float = 30.0  # the request's own deadline (control's request timeout)
    margin_s: float = 15.0  # past deadline + margin a request counts as hung
    seed: int = 0
    outcomes: list[Outcome] = field(default_factory=list)

    def prompts(self, sessions: int, turns: int) -> list[list[list[int]]]:
        rng = random.Random(self.seed)
        out = []
        for _ in range(sessions):
            base = [rng.randrange(1, self.vocab) for _ in range(rng.randrange(20, 70))]
            session = []
            for _ in range(turns):
                session.append(list(base))
                base = base + [rng.randrange(1, self.vocab) for _ in range(rng.randrange(5, 20))]
            out.append(session)
        return out

    async def run(self, sessions: int, turns: int, stream: bool = False) -> list[Outcome]:
        limits = httpx.Limits(max_connections=sessions + 4)
        async with httpx.AsyncClient(base_url=self.control_url, limits=limits) as client:
            results = await asyncio.gather(*(
                self._session(client, turns_of, stream)
                for turns_of in self.prompts(sessions, turns)))  # fmt: skip
        outcomes = [o for session in results for o in session]
        self.outcomes += outcomes
        return outcomes

    async def _session(self, client, prompts, stream) -> list[Outcome]:
        return [await self.one(client, prompt, stream) for prompt in prompts]

    async def one(self, client: httpx.AsyncClient, prompt: list[int], stream=False) -> Outcome:
        body = {"prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0.0}
        start = time.monotonic()
        try:
            async with asyncio.timeout(self.deadline_s + self.margin_s):
                response = await client.post("/v1/completions", json=body,
                                             timeout=self.deadline_s + self.margin_s)  # fmt: skip
        except TimeoutError:
            return Outcome(HUNG, latency_s=time.monotonic() - start)
        except httpx.TimeoutException:
            return Outcome(HUNG, latency_s=time.monotonic() - start)
        except httpx.HTTPError as exc:
            return Outcome(LOST, latency_s=time.monotonic() - start, reason=repr(exc)[:200])
        latency = time.monotonic() - start
        if response.status_code != 200:
            try:
                reason = str(response.json())[:300]
            except ValueError:
                return Outcome(LOST, response.status_code, latency, "no JSON reason")
            return Outcome(ERROR, response.status_code, latency, reason=reason)
        answer = response.json()
        got = answer["choices"][0]["token_ids"]
        ttft = float(answer.get("kvrelay", {}).get("ttft_s", latency) or latency)
        expected = await asyncio.to_thread(self.oracle.tokens, prompt, self.max_tokens)
        stopped = answer["choices"][0]["finish_reason"] == "stop"
        ok = got == expected[: len(got)] and (len(got) == len(expected) or stopped)
        return Outcome(CORRECT if ok else WRONG, 200, latency, ttft)
