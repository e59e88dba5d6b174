"""The prefill worker's front: a bounded queue, batches of up to
`--max-batch` requests sent to the ranks, one answer frame per request."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from kvrelay.model.errors import PoolExhausted, StagingTooSmall
from kvrelay.prefill.ranks import prefill_rank_setup
from kvrelay.rpc import Connection, Error, PeerError
from kvrelay.rpc.worker_ops import CachedTokens, ParallelShape, Prefill, PrefillReply, Role
from kvrelay.worker.front import WorkerConfig, WorkerFront, log
from kvrelay.worker.protocol import Busy, check_params, check_tokens, pages_of
from kvrelay.worker.rank_ops import DropHandles, PrefillBatch, PrefillItem, PrefillRan, RankPrefill

# How long the scheduler waits before asking again when staging rows are all
# held by published handles (released by decode, or expiring).
RETRY_S = 0.02


@dataclass(slots=True)
class _Pending:
    rid: str
    item: PrefillItem
    prompt_tokens: int
    future: asyncio.Future
    queued_at: float = field(default_factory=time.perf_counter)
    abandoned: bool = False  # control closed the connection before the answer


class PrefillWorker(WorkerFront):
    role = Role.PREFILL
    request_type = Prefill

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config, prefill_rank_setup)
        self._queue: list[_Pending] = []
        self._wake = asyncio.Event()
        self._running = 0
        self._batch: list[_Pending] = []  # the requests the ranks are working on

    def queued(self) -> int:
        return len(self._queue)

    def active(self) -> int:
        return self._running

    async def handle(self, conn: Connection, request: Prefill) -> None:
        rid = request.rid
        prompt_tokens = check_tokens(request.tokens, self.vocab)
        check_params(request.params, self.vocab)
        if self.draining or len(self._queue) >= self.config.max_queue:
            self.counters.busy_rejections += 1
            why = "draining" if self.draining else f"queue holds {len(self._queue)} requests"
            await conn.send(Error.of(Busy(why), rid))
            return
        # The pool holds the whole prompt; staging only its new pages (the
        # ranks refuse a request whose new pages exceed the arena).
        pages = pages_of(prompt_tokens, self.config.page_size)
        if pages > self.config.num_pages:
            self.counters.errors += 1
            await conn.send(Error.of(PoolExhausted(pages, self.config.num_pages), rid))
            return
        item = PrefillItem(request.tokens, request.params, request.lease_s)
        future = asyncio.get_running_loop().create_future()
        pending = _Pending(rid, item, prompt_tokens, future)
        self._queue.append(pending)
        self._wake.set()
        # Control sends nothing more: a recv that returns means it closed.
        closed = asyncio.create_task(conn.recv())
        try:
            await asyncio.wait({pending.future, closed}, return_when=asyncio.FIRST_COMPLETED)
            if not pending.future.done():
                # Gone before the answer: a queued request leaves the queue; one
                # the ranks are running drops its handles when it is done.
                pending.abandoned = True
                if pending not in self._batch and pending in self._queue:
                    self._queue.remove(pending)
                return
            exc = pending.future.exception()
            if exc is not None:
                self.counters.errors += 1
                await conn.send(Error.of(exc, rid))
                return
            answer = pending.future.result()
            if closed.done() or conn.closed_by_peer():
                await self._drop(answer)  # nobody will read or release them
                return
            try:
                await conn.send(answer)
            except PeerError:
                await self._drop(answer)
        finally:
            closed.cancel()
            if closed.done() and not closed.cancelled():
                closed.exception()  # retrieved: the close was expected

    async def _drop(self, answer: PrefillReply) -> None:
        """End the leases of an answer's handles now, freeing their staging rows."""
        handles = [h.handle for h in answer.handles]
        if handles:
            await self.ranks(DropHandles(handles))

    async def scheduler(self) -> None:
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = self._queue[: self.config.max_batch]
            self._running = len(batch)
            self._batch = batch
            try:
                ran: list[PrefillRan] = await self.ranks(PrefillBatch([p.item for p in batch]))
            except Exception as exc:
                log.error("prefill batch failed: %r", exc)
                for pending in batch:
                    if pending in self._queue:
                        self._queue.remove(pending)
                    if not pending.future.done() and not pending.abandoned:
                        pending.future.set_exception(exc)
                if not self.engine.alive:
                    self._fail_queue(RuntimeError("the worker's ranks are gone"))
                    return
                continue
            finally:
                self._running = 0
                self._batch = []
            refused = ran[0].refused
            if refused is not None:  # can never fit (its new pages exceed the staging arena)
                self._queue.remove(batch[0])
                if not batch[0].future.done():
                    batch[0].future.set_exception(StagingTooSmall(refused.message))
                continue
            done = len(ran[0].answers)
            if not done:
                await asyncio.sleep(RETRY_S)  # staging full: wait for releases
                continue
            for i, pending in enumerate(batch[:done]):
                self._queue.remove(pending)
                answer = self._merge([rank.answers[i] for rank in ran], pending)
                if pending.abandoned:
                    await self._drop(answer)
                elif not pending.future.done():
                    pending.future.set_result(answer)
            # Abandoned while their batch ran but not taken: nobody waits for them.
            self._queue = [p for p in self._queue if not p.abandoned]

    def _merge(self, per_rank: list[RankPrefill], pending: _Pending) -> PrefillReply:
        first = per_rank[0]
        cached = first.cached_local + first.cached_tier
        c = self.counters
        c.requests += 1
        c.prompt_tokens += pending.prompt_tokens
        c.computed_tokens += pending.prompt_tokens - cached
        c.local_hit_tokens += first.cached_local
        c.tier_hit_tokens += first.cached_tier
        c.generated_tokens += 1
        timings = dict(first.timings)
        timings["queue_s"] = time.perf_counter() - pending.queued_at - sum(timings.values())
        return PrefillReply(
            rid=pending.rid,
            first_token=first.first_token,
            finish_reason=first.finish_reason,
            prompt_tokens=pending.prompt_tokens,
            cached_tokens=CachedTokens(first.cached_local, first.cached_tier),
            tier_pages=first.tier_pages,
            pages=first.pages,
            spec=ParallelShape(self.config.tp, self.config.pp, self.config.cp),
            # none when finished (decode is not needed); the draft's last
            handles=[r.handle for r in per_rank if r.handle is not None]
            + [r.draft for r in per_rank if r.draft is not None],
            timings=timings,
        )

    def _fail_queue(self, exc: Exception) -> None:
        queue, self._queue = self._queue, []
        for pending in queue:
            if not pending.future.done():
                pending.future.set_exception(exc)
