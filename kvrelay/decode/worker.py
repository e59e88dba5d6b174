"""The decode worker's front: requests wait in a bounded queue, are loaded
into the ranks (pool, tier, prefill handles) and admitted into the running
batch; every engine step streams each sequence's new token to its
connection. A closed connection cancels its sequence."""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from dataclasses import dataclass, field

from kvrelay.decode.ranks import decode_rank_setup
from kvrelay.model.errors import PoolExhausted, RequestError
from kvrelay.rpc import Connection, Error, PeerError
from kvrelay.rpc.worker_ops import Decode, DecodeDone, DraftPulled, Pulled, Role, TokenBatch
from kvrelay.worker.front import WorkerConfig, WorkerFront, log
from kvrelay.worker.protocol import Busy, check_params, check_tokens
from kvrelay.worker.rank_ops import Cancel, LoadDone, LoadStart, Step, Stepped

# How often the ranks are asked whether pulls finished while nothing runs.
LOAD_POLL_S = 0.002


@dataclass(slots=True)
class _Job:
    rid: str
    request: Decode
    prompt_tokens: int
    frames: asyncio.Queue = field(default_factory=asyncio.Queue)
    seq_id: int | None = None
    cancelled: bool = False
    pulled: dict = field(default_factory=dict)
    finish_reason: str | None = None
    written: list[int] = field(default_factory=list)  # pages each writer rank wrote back
    writing: set[int] = field(default_factory=set)  # ranks whose write-back still runs
    spec: dict | None = None  # speculation counts of the request (--speculative)
    draft_pulled: DraftPulled | None = None  # draft pages restored, by source (--speculative)


class DecodeWorker(WorkerFront):
    role = Role.DECODE
    request_type = Decode

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config, decode_rank_setup)
        self._waiting: deque[_Job] = deque()
        self._running: dict[int, _Job] = {}
        self._loading: dict[int, _Job] = {}  # pulls in flight, by load id
        self._writing: dict[int, _Job] = {}  # finished, write-back in flight, by seq id
        self._load_ids = itertools.count(1)
        self._blocked = False
        self._wake = asyncio.Event()

    def queued(self) -> int:
        return len(self._waiting)

    def active(self) -> int:
        return len(self._running) + len(self._loading)

    async def handle(self, conn: Connection, request: Decode) -> None:
        rid = request.rid
        prompt_tokens = check_tokens(request.tokens, self.vocab)
        check_params(request.params, self.vocab)
        first = request.first_token
        if first >= self.vocab:
            raise RequestError(f"first_token must be an integer in [0, {self.vocab})")
        if request.params.max_new_tokens < 2 or first in request.params.stop_token_ids:
            raise RequestError("nothing to decode: prefill's first token already ends it")
        if self.draining or len(self._waiting) >= self.config.max_queue:
            self.counters.busy_rejections += 1
            await conn.send(Error.of(Busy("draining or queue full"), rid))
            return
        job = _Job(rid, request, prompt_tokens)
        self._waiting.append(job)
        self._wake.set()
        # Control sends nothing more: a recv that returns means it closed (cancel).
        closed = asyncio.create_task(conn.recv())
        try:
            while True:
                frame = asyncio.create_task(job.frames.get())
                await asyncio.wait({frame, closed}, return_when=asyncio.FIRST_COMPLETED)
                if not frame.done():
                    frame.cancel()
                    job.cancelled = True
                    self._wake.set()
                    return
                message = frame.result()
                await conn.send(message)
                if isinstance(message, DecodeDone | Error):
                    return
        except PeerError:
            job.cancelled = True
            self._wake.set()
        finally:
            closed.cancel()
            if closed.done() and not closed.cancelled():
                closed.exception()  # retrieved: the close was expected

    # -- the running batch --------------------------------------------------------
    async def scheduler(self) -> None:
        while True:
            try:
                await self._start_loads()
                await self._drop_cancelled()
                if self._running or self._loading or self._writing:
                    await self._step()
                    if not self._running:
                        # Only pulls or writes in flight: poll them without spinning.
                        await asyncio.sleep(LOAD_POLL_S)
                elif not self._waiting or self._blocked:
                    self._wake.clear()
                    await self._wake.wait()
            except Exception as exc:  # the ranks are gone or out of step
                log.error("decode scheduler: %r", exc)
                running = dict(self._running)
                jobs = [*self._waiting, *self._loading.values(), *running.values()]
                jobs += self._writing.values()
                self._writing.clear()
                self._waiting.clear()
                self._loading.clear()  # a load finishing later is cancelled in _step
                self._running.clear()
                for job in jobs:
                    self._fail(job, exc)
                if not self.engine.alive:
                    return
                # The ranks are still up: give the failed sequences' pages back.
                for seq_id in running:
                    try:
                        await self.ranks(Cancel(seq_id))
                    except Exception as again:
                        log.error("decode: cancelling %d failed: %r", seq_id, again)

    async def _start_loads(self) -> None:
        self._blocked = False
        while self._waiting and len(self._running) + len(self._loading) < self.config.max_batch:
            job = self._waiting[0]
            if job.cancelled:
                self._waiting.popleft()
                continue
            r = job.request
            load = LoadStart(next(self._load_ids), r.tokens, r.first_token, r.params, r.pages,
                             r.tier_pages, r.handles)  # fmt: skip
            try:
                started = await self.ranks(load)
            except PoolExhausted as exc:
                if self._running or self._loading or self._writing:
                    # Pages and staging rows come back as sequences finish and
                    # as write-backs (which hold rows) end: wait, don't fail.
                    self._blocked = True
                    return
                self._waiting.popleft()
                self._fail(job, exc)
                continue
            except RequestError as exc:
                self._waiting.popleft()
                self._fail(job, exc)
                continue
            self._waiting.popleft()
            job.pulled = {"local_pages": started[0].local_pages}
            self._loading[load.load_id] = job

    def _loaded(self, per_rank: list[list[LoadDone]]) -> list[int]:
        """Loads the ranks finished: their jobs run, or fail. Returns the
        sequences to cancel (their job is gone)."""
        orphans = []
        for i, answer in enumerate(per_rank[0]):
            job = self._loading.pop(answer.load_id, None)
            if answer.error is not None:
                if job is not None:
                    self.counters.errors += 1
                    job.frames.put_nowait(Error(answer.error.error, answer.error.message, job.rid))
                continue
            if job is None:
                orphans.append(answer.seq_id)
                continue
            job.seq_id = answer.seq_id
            job.pulled |= {"tier_pages": answer.tier_pages, "prefill_pages": answer.prefill_pages}
            # The draft's counts come from a rank of the last PP stage.
            job.draft_pulled = next((r[i].draft for r in per_rank if r[i].draft is not None), None)
            recomputed = answer.recomputed_pages
            if recomputed:  # neither the tier nor prefill had them: computed here
                job.pulled["recomputed_pages"] = recomputed
            self._running[job.seq_id] = job
            c = self.counters
            c.requests += 1
            c.prompt_tokens += job.prompt_tokens
            c.computed_tokens += 1  # prefill's first token: its KV is computed here
            c.computed_tokens += recomputed * self.config.page_size
            c.local_hit_tokens += answer.local_pages * self.config.page_size
            c.tier_hit_tokens += answer.tier_pages * self.config.page_size
            c.bytes_from_prefill += sum(r[i].bytes_from_prefill for r in per_rank)
        return orphans

    def _fail(self, job: _Job, exc: Exception) -> None:
        self.counters.errors += 1
        job.frames.put_nowait(Error.of(exc, job.rid))

    async def _drop_cancelled(self) -> None:
        for seq_id, job in list(self._running.items()):
            if job.cancelled:
                await self.ranks(Cancel(seq_id))
                del self._running[seq_id]

    async def _step(self) -> None:
        per_rank: list[Stepped] = await self.ranks(Step())
        for seq_id in self._loaded([r.loads for r in per_rank]):
            await self.ranks(Cancel(seq_id))
        outputs = [r.outputs for r in per_rank]
        for i, out in enumerate(outputs[0]):
            job = self._running.get(out.seq_id)
            if job is None:
                continue
            self.counters.generated_tokens += len(out.tokens) // 4  # packed: 4 bytes a token
            if out.tokens:
                job.frames.put_nowait(TokenBatch(job.rid, out.tokens))
            if out.finish_reason is None:
                continue
            del self._running[out.seq_id]
            job.finish_reason = out.finish_reason
            job.spec = out.spec
            if job.spec:
                self.counters.spec_proposed += job.spec["proposed"]
                self.counters.spec_accepted += job.spec["accepted"]
                self.counters.spec_steps += job.spec["steps"]
            job.written = [r[i].written for r in outputs if r[i].written is not None]
            job.writing = {rank for rank, r in enumerate(outputs) if r[i].writing}
            if job.writing:
                self._writing[out.seq_id] = job  # done once the tier writes finish
            else:
                self._done(job)
        for rank, r in enumerate(per_rank):
            for seq_id, pages in r.writes_done:
                job = self._writing.get(seq_id)
                if job is not None:
                    job.writing.discard(rank)
                    job.written.append(pages)
                    if not job.writing:
                        del self._writing[seq_id]
                        self._done(job)

    def _done(self, job: _Job) -> None:
        job.frames.put_nowait(
            DecodeDone(
                job.rid,
                job.finish_reason,
                Pulled(**job.pulled),
                min(job.written) if job.written else 0,
                job.spec,
                job.draft_pulled,
            )
        )
