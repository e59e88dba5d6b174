"""Cache-aware choice of workers and running one request: prefill, then decode.

Choice (prefill): score = max(tier hit, local hit) in pages, where the tier
hit comes from probing the cache servers and the local hit from the node's
`PageEstimate` (keys control sent it). Among nodes within one page of the
best score the least loaded wins (queued + active + control's in-flight);
the rest follow by score, then load, as fallbacks. Decode: the same with
the decode nodes' estimates (they hold whole conversations, answer
included), so a conversation's next turn returns to its decode worker.

Failures (see docs/architecture.md): `Busy` -> next worker, not a retry
(when every worker is busy, the request waits for capacity within its
deadline); a refused connection removes the node, any other fault makes it suspect; both
retry elsewhere, at most `max_retries` times per request. A decode that
fails before streaming a token is retried on another decode worker with the
same handles while their lease holds, else the request goes back to
prefill with the tokens already sent appended to the prompt; a decode that
answers `PullFailed` (the handles' prefill died, or their lease ended) is
not at fault and stays in rotation: the request goes back to prefill at
once (a retry), since no decode can pull those handles. After decode
tokens were streamed, the request resumes: prefill of the prompt plus the
tokens sent, then another decode worker (502 in-stream when none is left).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from kvrelay.control.config import ControlConfig
from kvrelay.control.events import Done, Event, FirstToken, Tokens
from kvrelay.control.registry import Node, Registry
from kvrelay.control.stats import ControlStats, ttft_phases
from kvrelay.control.tier import TierProbe
from kvrelay.control.worker_client import (
    HandlesGone,
    WorkerBusy,
    WorkerCall,
    WorkerError,
    WorkerRefused,
    WorkerRejected,
)
from kvrelay.layout.keys import page_keys, scheme_page_keys
from kvrelay.rpc import pack_tokens, unpack_tokens
from kvrelay.rpc.worker_ops import Decode, DecodeDone, Params, Prefill, PrefillReply, TokenBatch

log = logging.getLogger(__name__)

LEASE_MARGIN_S = 1.0  # don't reuse handles this close to their expiry


class DispatchError(Exception):
    """The request failed; `status` is the HTTP answer, `streamed` whether
    the client already got tokens (then it can only be told in-stream)."""

    def __init__(self, status: int, message: str, streamed: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.streamed = streamed


@dataclass(slots=True)
class Job:
    rid: str
    model: str
    tokens: list[int]
    params: dict  # SamplingParams fields, max_new_tokens = the client's max_tokens
    keys: dict = field(default_factory=dict)  # (scheme, namespace, page_size) -> page keys
    current: Node | None = None  # the worker of the latest attempt (blamed for a timeout)
    tier_hit: int | None = None  # pages, probed once per request
    waiting: bool = False  # every prefill worker answered Busy; waiting for one
    decode_first_s: float | None = None  # decode request sent -> its first token batch
    packed_tokens: bytes | None = None  # `tokens` as the wire carries them, packed once

    def packed(self, prompt: list[int]) -> bytes:
        """`pack_tokens(prompt)` for a prompt that starts with the job's tokens
        (they, plus what was generated): the job's part is packed once per
        request, not once per message and attempt."""
        return self._packed_tokens() + pack_tokens(prompt[len(self.tokens) :])

    def _packed_tokens(self) -> bytes:
        if self.packed_tokens is None:
            self.packed_tokens = pack_tokens(self.tokens)
        return self.packed_tokens

    def page_keys(self, node: Node, tokens: list[int] | None = None) -> list[bytes]:
        """Keys of the job's prompt (computed once per key scheme, namespace
        and page size), or of `tokens`, the prompt and what was generated
        after it: the prompt's chain extended by the pages that follow (a
        request's keys are hashed once, not once per hop). An SGLang-scheme
        chain is not extended from a key (its links are not kept): hashed anew."""
        scheme = node.key_scheme
        cache_key = (scheme, node.namespace, node.page_size)
        if cache_key not in self.keys:
            tokens_u32 = np.frombuffer(self._packed_tokens(), dtype="<u4")
            self.keys[cache_key] = scheme_page_keys(
                scheme, node.namespace, tokens_u32, node.page_size
            )
        keys = self.keys[cache_key]
        if tokens is None:
            return keys
        ps, full = node.page_size, len(keys)
        extends = (
            len(tokens) >= len(self.tokens) and tokens[: full * ps] == self.tokens[: full * ps]
        )
        if scheme != "kvrelay" or not extends:
            return scheme_page_keys(scheme, node.namespace, tokens, ps)
        parent = keys[-1] if keys else node.namespace
        return keys + page_keys(parent, tokens[full * ps :], ps)


def _malformed(exc: WorkerError) -> bool:
    """The worker refused the request itself as bad input: the client's fault."""
    return isinstance(exc, WorkerRejected) and exc.error == "RequestError"


def rank(nodes: list[Node], scores: dict[str, int]) -> list[Node]:
    """Nodes within one page of the best score by load, then the rest by score, load."""
    if not nodes:
        return []
    best = max(scores[n.node_id] for n in nodes)
    near = sorted((n for n in nodes if scores[n.node_id] >= best - 1), key=lambda n: n.load)
    rest = sorted(
        (n for n in nodes if scores[n.node_id] < best - 1),
        key=lambda n: (-scores[n.node_id], n.load),
    )
    return near + rest


class Dispatcher:
    def __init__(self, config: ControlConfig, registry: Registry, stats: ControlStats,
                 tier: TierProbe | None) -> None:  # fmt: skip
        self.config = config
        self.registry = registry
        self.stats = stats
        self.tier = tier

    def _candidates(self, role: str, job: Job, exclude: set[str]) -> list[Node]:
        return [n for n in self.registry.in_rotation(role, job.model) if n.node_id not in exclude]

    async def _prefill_order(self, job: Job, exclude: set[str]) -> list[Node]:
        nodes = self._candidates("prefill", job, exclude)
        if not nodes:
            return []
        if job.tier_hit is None:
            job.tier_hit = 0
            if self.tier is not None and self.tier.servers:
                keys = job.page_keys(nodes[0])
                probe_started = time.monotonic()
                job.tier_hit = await self.tier.probe(nodes[0].namespace, keys)
                self.stats.record_tier_probe(time.monotonic() - probe_started)
                self.stats.probed_tier_tokens += job.tier_hit * nodes[0].page_size
        scores = {n.node_id: max(job.tier_hit, n.estimate.hit(job.page_keys(n))) for n in nodes}
        return rank(nodes, scores)

    def _decode_order(self, job: Job, exclude: set[str]) -> list[Node]:
        nodes = self._candidates("decode", job, exclude)
        return rank(nodes, {n.node_id: n.estimate.hit(job.page_keys(n)) for n in nodes})

    def _retry(self, budget: list[int], what: str, exc: WorkerError) -> None:
        """Spend one retry of the request (or give up)."""
        budget[0] += 1
        if budget[0] > self.config.max_retries:
            raise DispatchError(502, f"{what} failed {budget[0]} times, last: {exc}")
        self.stats.retries += 1

    async def run(self, job: Job) -> AsyncIterator[Event]:
        """Events: `FirstToken` (prefill answered), `Tokens` (a decode batch),
        `Done`. Raises DispatchError; never outlives the request timeout."""
        started = time.monotonic()
        emitted: list[int] = []
        budget = [0]  # retries spent, shared by prefill and decode
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                if job.params["max_new_tokens"] > 1 and not self._decode_order(job, set()):
                    # Don't hold a prefill worker's pages for a decode that cannot run.
                    raise DispatchError(503, f"no decode worker available for {job.model}")
                while True:
                    prompt = job.tokens + emitted
                    left = job.params["max_new_tokens"] - len(emitted)
                    if left <= 0:  # a decode died after its last token, before its done frame
                        yield Done("length")
                        return
                    params = dict(job.params, max_new_tokens=left)
                    reply, pnode = await self._prefill(job, prompt, params, budget)
                    margin = min(LEASE_MARGIN_S, self.config.lease_s / 4)
                    lease_end = time.monotonic() + self.config.lease_s - margin
                    event = FirstToken([reply.first_token], pnode.node_id)
                    if not emitted:
                        self._first_answer(job, reply, event, time.monotonic() - started)
                    emitted.append(reply.first_token)
                    yield event
                    if reply.finish_reason:
                        yield Done(reply.finish_reason)
                        return
                    decode = self._decode(job, prompt, params, reply, lease_end, emitted, budget)
                    try:
                        async for event in decode:
                            yield event
                            if isinstance(event, Done):
                                return
                    finally:
                        await decode.aclose()  # closes its worker connection at once
                    # Decode could not run on these handles: prefill again.
        except TimeoutError:
            if job.waiting:
                raise DispatchError(
                    503, f"every prefill worker for {job.model} stayed busy until the "
                         f"request's deadline ({self.config.request_timeout_s:g} s)",
                ) from None  # fmt: skip
            if job.current is not None:
                self.registry.suspect(job.current)  # it held the request until the deadline
            raise DispatchError(
                504, f"request timed out after {self.config.request_timeout_s:g} s",
                streamed=len(emitted) > 0,
            ) from None  # fmt: skip

    def _first_answer(self, job: Job, reply: PrefillReply, event: FirstToken, ttft_s: float):
        """The request's first token: TTFT, its phases and the cache hits go
        into `event` and the stats (a resumed request's later prefills don't)."""
        cached = reply.cached_tokens
        event.cached = {"local": cached.local, "tier": cached.tier}
        event.ttft_s = ttft_s
        event.prefill_timings = dict(reply.timings)
        self.stats.record_ttft(ttft_s)
        self.stats.record_prefill_phases(event.prefill_timings)
        phases = ttft_phases(ttft_s, event.prefill_timings)
        self.stats.record_ttft_phases(len(job.tokens), phases)
        self.stats.record_prefill(len(job.tokens), **event.cached)

    @contextlib.asynccontextmanager
    async def _attempt(self, job: Job, node: Node, tried: set[str]) -> AsyncIterator[WorkerCall]:
        """One prefill or decode attempt on `node`: in flight (the node's load,
        blamed for a timeout) until it ends, then, however it ends, capacity
        is announced and the connection closes. Failures are handled inside
        the block: a faulty node leaves rotation before capacity is announced."""
        tried.add(node.node_id)
        call = WorkerCall(node, self.config.token, self.config.connect_timeout_s)
        job.current = node
        node.inflight += 1
        try:
            yield call
        finally:
            node.inflight -= 1
            self.registry.capacity_changed()
            call.close()

    def _answer_of(self, role: str, job: Job, node: Node, exc: WorkerError, budget: list[int],
                   streamed: bool = False) -> str:  # fmt: skip
        """A failed attempt, prefill or decode: bad input is the client's (400),
        a busy or rejecting worker is passed over, a fault takes the node out
        of rotation and spends a retry. Returns the reason, for a 503 later."""
        if _malformed(exc):
            raise DispatchError(400, f"rejected by {node.node_id}: {exc}",
                                streamed=streamed) from exc  # fmt: skip
        if isinstance(exc, WorkerBusy):
            self.stats.busy += 1
        elif not isinstance(exc, WorkerRejected):  # a fault: out of rotation, one retry
            refused = isinstance(exc, WorkerRefused)
            (self.registry.refused if refused else self.registry.suspect)(node)
            self._retry(budget, role, exc)
        return str(exc)

    @staticmethod
    def _none_left(role: str, job: Job, last: str | None, streamed: bool = False):
        why = f" (last: {last})" if last else ""
        return DispatchError(503, f"no {role} worker available for {job.model}{why}",
                             streamed=streamed)  # fmt: skip

    async def _prefill(self, job: Job, prompt: list[int], params: dict,
                       budget: list[int]) -> tuple[PrefillReply, Node]:  # fmt: skip
        tried: set[str] = set()
        busy: set[str] = set()
        last: str | None = None
        rejected: WorkerRejected | None = None
        while True:
            order = await self._prefill_order(job, tried)
            if not order and busy and rejected is None:
                # Every worker left is busy: wait for one to free up (a heartbeat,
                # a node, a request of ours ending), within the request's deadline.
                await self._wait_for_capacity(job)
                tried -= busy
                busy.clear()
                continue
            if not order:
                if rejected is not None:
                    raise DispatchError(400, f"{rejected.error}: {rejected}")
                raise self._none_left("prefill", job, last)
            node = order[0]
            message = Prefill(job.rid, job.packed(prompt), Params(**params), self.config.lease_s)
            async with self._attempt(job, node, tried) as call:
                try:
                    await call.open()
                    await call.send(message)
                    reply = await call.recv(PrefillReply, self.config.attempt_timeout_s)
                except WorkerError as exc:
                    if isinstance(exc, WorkerBusy):
                        busy.add(node.node_id)
                    else:
                        job.waiting = False
                    if isinstance(exc, WorkerRejected):
                        rejected = exc  # PoolExhausted: another worker may have a bigger pool
                    last = self._answer_of("prefill", job, node, exc, budget)
                    continue
            job.waiting = False
            node.estimate.add(job.page_keys(node, prompt))
            return reply, node

    async def _stream(self, job: Job, node, call: WorkerCall, message: Decode,
                      emitted: list[int]) -> AsyncIterator[Tokens | Done]:  # fmt: skip
        """One decode attempt on `node`: an event per token batch as it comes
        (appended to `emitted`), then the done event."""
        await call.open()
        await call.send(message)
        last_at, streamed = time.monotonic(), 0
        while True:
            frame = await call.recv(
                TokenBatch | DecodeDone, None if streamed else self.config.attempt_timeout_s
            )
            tokens = unpack_tokens(frame.tokens) if isinstance(frame, TokenBatch) else []
            if tokens:
                now = time.monotonic()
                if not streamed:
                    job.decode_first_s = now - last_at
                    self.stats.record_transfer(now - last_at, len(job.tokens))
                self.stats.record_gap(now - last_at, len(tokens))
                last_at = now
                streamed += len(tokens)
                emitted.extend(tokens)
                yield Tokens(tokens, node.node_id)
            if isinstance(frame, DecodeDone):
                node.estimate.add(job.page_keys(node, job.tokens + emitted))
                yield Done(frame.finish_reason, node.node_id, job.decode_first_s)
                return

    def _resume_after(self, node: Node, exc: WorkerError, streamed: int, job: Job,
                      budget: list[int]) -> None:  # fmt: skip
        """A decode failed after streaming tokens. The client keeps them; the
        request resumes (prefill of the prompt plus every token sent, then
        another decode worker) when a retry is left and another decode worker
        is in rotation, else it ends with 502 in-stream. Greedy output is
        unchanged by the resume; a seeded sample continues validly but not as
        the uninterrupted run would have."""
        why = f"decode {node.node_id} failed after {streamed} tokens: {exc}"
        if not isinstance(exc, WorkerRejected):
            self.registry.suspect(node)
        if budget[0] >= self.config.max_retries or not self._decode_order(job, {node.node_id}):
            raise DispatchError(502, why, streamed=True) from exc
        self._retry(budget, "decode", exc)  # one is left: it does not raise
        self.stats.resumed += 1
        log.warning("%s; resuming request %s from its %d tokens", why, job.rid, streamed)

    async def _wait_for_capacity(self, job: Job) -> None:
        """Until the registry reports a change in capacity; the request's
        timeout (around `run`) bounds the wait, and no node is blamed for it."""
        job.current = None
        job.waiting = True  # until a worker answers anything but Busy
        self.stats.busy_waits += 1
        await self.registry.wait_for_capacity()

    async def _decode(self, job: Job, prompt: list[int], params: dict, prefill: PrefillReply,
                      lease_end: float, emitted: list[int],
                      budget: list[int]) -> AsyncIterator[Tokens | Done]:  # fmt: skip
        tried: set[str] = set()
        message = Decode(
            job.rid, job.packed(prompt), prefill.first_token, prefill.pages, Params(**params),
            prefill.tier_pages, prefill.handles,
        )  # fmt: skip
        last: str | None = None
        # The first attempt always runs; a retry only while the handles' lease holds.
        while not tried or time.monotonic() < lease_end:
            order = self._decode_order(job, tried)
            if not order:
                raise self._none_left("decode", job, last, streamed=True)
            node = order[0]
            before = len(emitted)
            async with self._attempt(job, node, tried) as call:
                try:
                    async for event in self._stream(job, node, call, message, emitted):
                        yield event
                    return
                except HandlesGone as exc:
                    # No decode can pull these handles (a pull precedes any token),
                    # and this one is not at fault: run() prefills again.
                    self._retry(budget, "decode", exc)
                    return
                except WorkerError as exc:
                    streamed = len(emitted) - before
                    if streamed and not isinstance(exc, WorkerBusy) and not _malformed(exc):
                        self._resume_after(node, exc, streamed, job, budget)
                        return  # run() prefills the prompt plus the tokens sent, then decodes on
                    last = self._answer_of("decode", job, node, exc, budget, streamed=True)
