"""The decode commands each rank runs (built inside the rank process).

`load` brings a prompt's KV into the pool (pool hits, then the tier, then
the prefill handles, each rank only its rectangle) and admits the sequence
into the engine's running batch; `step` advances the batch one token;
`cancel` drops a sequence. Decisions that depend on a rank's own state are
agreed with `min_all`, so every rank raises the same error or none.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from dataclasses import dataclass

from kvrelay.decode.pulls import pull_target, pull_tier_windowed, release_handles
from kvrelay.layout import rank_rectangle
from kvrelay.model.engine import Request
from kvrelay.model.errors import PoolExhausted, RequestError
from kvrelay.model.page_export import export_prefix, import_prefix
from kvrelay.rpc import pack_tokens, unpack_tokens
from kvrelay.worker.protocol import pages_of, sampling
from kvrelay.worker.rank import PullFailed, RankOptions, RoleRanks
from kvrelay.worker.rank_ops import (
    Cancel,
    Counters,
    DraftPulled,
    LoadDone,
    LoadStart,
    LoadStarted,
    RankCounters,
    Refusal,
    SeqOutput,
    Step,
    Stepped,
)

log = logging.getLogger("kvrelay.decode")


@dataclass(slots=True)
class _Load:
    item: LoadStart
    tokens: list[int]  # the prompt
    request: Request
    hit: list[int]  # pool pages of the prompt, referenced until the load ends
    local: int
    rows: list[int]
    need: int
    pulls: concurrent.futures.Future
    draft_hit: list[int]  # draft pool pages of the prompt, referenced until the load ends
    draft_rows: list[int]
    windowed: int  # of `local`, the tier's pages pulled through a window at the start


class DecodeRanks(RoleRanks):
    def __init__(self, engine, options: RankOptions) -> None:
        self.loads: dict[int, _Load] = {}  # in start order
        self.reserved = 0  # pool pages promised to loads in flight
        # seq_id -> (tier write running on the loop, its staging rows)
        self.writes: dict[int, tuple[concurrent.futures.Future, list[int]]] = {}
        # Full pages a write-back left out because staging had no free row
        # for them (reported in the worker's stats, never skipped silently).
        self.writeback_skipped_pages = 0
        super().__init__(engine, options, {
            LoadStart: self.load_start,
            Step: self.step,
            Cancel: lambda message: self.engine.cancel(message.seq_id),
        })  # fmt: skip

    def counters(self, _: Counters) -> RankCounters:
        return self.rt.counters(writeback_skipped_pages=self.writeback_skipped_pages)

    # -- bringing the prompt's KV in ---------------------------------------------
    def load_start(self, item: LoadStart) -> LoadStarted:
        """Reserves room for a request and starts pulling its pages on the
        agent's loop (the tier, then the prefill handles); the running batch
        keeps stepping meanwhile. `step` finishes the load once every rank's
        pulls are done. PoolExhausted (agreed) when the room is not there now."""
        tokens = unpack_tokens(item.tokens)
        keys = self.engine.spec.page_keys(tokens)
        pages = pages_of(len(tokens), self.ps)
        request = self._request(item, tokens, pages)
        pool = self.engine.pool
        # References on the pool's pages of the prompt keep them through the load.
        hit = pool.match_prefix(keys) if self.rt.options.local_cache else []
        local = self.rt.agree(len(hit))
        # Pages of the whole sequence, plus one for the copy of the partial
        # page the admission makes; loads in flight have reserved theirs.
        need = pages_of(len(tokens) + request.params.max_new_tokens, self.ps) + 1 - local
        room = pool.free_pages - self.reserved
        # Draft pages of prompt + first token (with the MTP layer): the pool's, then rows.
        draft_keys = self.draft.keys(request.prompt)
        draft_hit = self.draft.pool_hits(draft_keys)
        draft_need = len(draft_keys) - len(draft_hit)
        # The tier's pages after `local`: a row each when the free rows hold
        # the whole prompt (pulled on the loop with the rest); else pulled
        # here first, through a window of at most TIER_WINDOW rows, into the
        # pool (so a long context needs no more rows than the window).
        tier_end = max(local, min(item.tier_pages, len(keys)))
        span = tier_end - local if self.rt.cache is not None else 0
        all_rows = pages - local + draft_need
        windowed = span > 0 and not self.rt.agree(self.rt.rows.free >= all_rows)
        held = all_rows - span if windowed else all_rows  # rows the load keeps
        fits = room >= need and self.rt.rows.free >= held + windowed
        if not self.rt.agree(fits):
            self._release_hits(hit, draft_hit)
            raise PoolExhausted(need, max(room, 0))
        first = local
        if windowed:
            try:
                free = self.rt.rows.free - held
                pulled = pull_tier_windowed(self.rt, tokens, keys, local, tier_end, free)
            except BaseException:
                self._release_hits(hit, draft_hit)
                raise
            hit += pulled
            local += len(pulled)
            need -= len(pulled)
            rows = self.rt.rows.take(pages - tier_end)  # prefill's pages
            tier_end = local  # nothing more to take from the tier
        else:
            rows = self.rt.rows.take(pages - local)
        draft_rows = self.rt.rows.take(draft_need)
        self.reserved += need
        draft = (draft_keys, len(draft_hit), draft_rows, [h for h in item.handles if h.draft])
        pulls = asyncio.run_coroutine_threadsafe(
            self._pull_both(item, keys, local, pages, rows, draft, tier_end), self.rt.loop
        )
        self.loads[item.load_id] = _Load(
            item, tokens, request, hit, local, rows, need, pulls, draft_hit, draft_rows,
            local - first,
        )  # fmt: skip
        return LoadStarted(first)

    def _request(self, item: LoadStart, tokens: list[int], pages: int) -> Request:
        """The engine's request: the prompt and prefill's first token, whose
        draw the sampler skips (it has one token less to generate)."""
        if item.pages != pages:
            raise RequestError(f"pages={item.pages} but the prompt has {pages} pages")
        left = sampling(item.params, max_new_tokens=item.params.max_new_tokens - 1)
        return Request([*tokens, item.first_token], left, skip_draws=1)

    def _release_hits(self, hit: list[int], draft_hit: list[int]) -> None:
        """Drops a load's references on its pool pages (target and draft)."""
        self.engine.pool.release(hit)
        if draft_hit:
            self.engine.draft.pool.release(draft_hit)

    async def _pull_both(self, item, keys, local, pages, rows, draft, tier_end) -> dict:
        """The target's pulls, then the draft's (best effort, never failing the load)."""
        pulled = await pull_target(self.rt, item, keys, local, pages, rows, tier_end)
        keys, first, rows, handles = draft
        if self.draft.active:
            counts = await self.draft.pull(keys, first, rows, handles)
            pulled["draft"] = DraftPulled(first, counts["tier"], counts["prefill"])
        return pulled

    def _finish_loads(self) -> list[LoadDone]:
        """Loads whose pulls are done on every rank: scatter into the pool and
        admit, or fail (PullFailed on every rank). Answers per load."""
        answers = []
        for load_id, load in list(self.loads.items()):
            if not self.rt.agree(load.pulls.done()):
                continue
            why = ""
            try:
                pulled = load.pulls.result()
            except Exception as exc:
                why, pulled = f"{type(exc).__name__}: {exc}", {}
            # Also the barrier: every rank has read before rank 0 releases.
            ok = self.rt.agree(not why)
            if self.engine.parallel.rank == 0:
                # In the background: a slow or dead prefill must not hold the batch.
                # (target and draft handles alike).
                handles = load.item.handles
                asyncio.run_coroutine_threadsafe(
                    release_handles(self.rt.agent, handles), self.rt.loop
                )
            answer = LoadDone(load_id, load.local - load.windowed)
            try:
                if not ok:
                    raise PullFailed(why or "another rank failed to pull its pages")
                self._admit(load, pulled, answer)
            except (PullFailed, PoolExhausted, RequestError) as exc:
                answer.error = Refusal(type(exc).__name__, str(exc))
            finally:
                del self.loads[load_id]
                self.rt.rows.give_back(load.rows + load.draft_rows)
                self._release_hits(load.hit, load.draft_hit)
                self.reserved -= load.need
            answers.append(answer)
        if answers and not self.rt.options.local_cache:
            self.rt.clear_cache()
        return answers

    def _admit(self, load: _Load, pulled: dict, answer: LoadDone) -> None:
        """Imports a finished load's pulled pages into the pool and admits its
        sequence (the engine computes the pages neither source had)."""
        tokens = load.tokens
        pages = pages_of(len(tokens), self.ps)
        have = self.rt.agree(pulled["have"])
        if have < pages:
            tokens = tokens[: have * self.ps]  # the engine computes the rest
            answer.recomputed_pages = pages - have
        if load.rows and have > load.local:
            ids = [load.rows[0]] * load.local + load.rows
            import_prefix(self.engine, tokens, self.rt.staging, ids)
        if pulled.get("draft"):
            self._import_draft(load, pulled["draft"], answer)
        answer.seq_id = self.engine.admit(load.request)
        answer.tier_pages = self.rt.agree(pulled["tier_pages"]) + load.windowed
        answer.prefill_pages = pulled["prefill_pages"]
        answer.bytes_from_prefill = pulled["bytes_from_prefill"]

    def _import_draft(self, load: _Load, counts: DraftPulled, answer: LoadDone) -> None:
        """Index the draft pages pulled; the engine's admission restores them
        with the target's (and recomputes from the first one missing)."""
        local = counts.local_pages
        have = local + counts.tier_pages + counts.prefill_pages
        self.draft.import_rows(load.request.prompt, have, local, load.draft_rows)
        answer.draft = counts

    # -- generation ----------------------------------------------------------------
    def step(self, _: Step) -> Stepped:
        """Finish the loads that are done (their sequences join the batch),
        then one step of the batch; report write-backs that completed."""
        loads = self._finish_loads()
        out = []
        for output in self.engine.step():
            written, writing = None, False
            if output.finish_reason is not None and self.rt.options.write_back:
                written, writing = self._write_back(output.seq_id, output.all_tokens)
            out.append(SeqOutput(output.seq_id, pack_tokens(output.tokens), output.finish_reason,
                                 output.spec, written, writing))  # fmt: skip
        return Stepped(loads, out, self._writes_done())

    def _write_back(self, seq_id: int, tokens: list[int]) -> tuple[int | None, bool]:
        """Exports a finished sequence's full pages (prompt and answer) into
        staging rows and starts writing them to the tier in the background.
        Returns (pages written if already known, whether a write runs); None
        pages on a rank that writes nothing (a replica, no tier)."""
        if self.rt.cache is None or not rank_rectangle(self.rt.spec, self.engine.parallel).writer:
            return None, False
        full = (len(tokens) - 1) // self.ps
        # Rows are held by loads and earlier write-backs in flight, and the
        # finished sequence's pool pages go back now, so waiting for rows is
        # not an option: write the prefix that fits (still a valid chain of
        # keys) and count the pages left out.
        fits = min(full, self.rt.rows.free)
        if fits < full:
            self.writeback_skipped_pages += full - fits
            log.warning("decode write-back: %d of %d pages skipped, no free staging rows",
                        full - fits, full)  # fmt: skip
        if not fits:
            return 0, False
        full = fits
        rows = self.rt.rows.take(full)
        try:
            export_prefix(self.engine, tokens[: full * self.ps], self.rt.staging, rows)
        except BaseException:
            self.rt.rows.give_back(rows)
            raise
        keys = self.rt.spec.page_keys(tokens[: full * self.ps])
        write = self.rt.cache.write(keys, self.rt.arena, self.rt.offsets(rows))
        self.writes[seq_id] = (asyncio.run_coroutine_threadsafe(write, self.rt.loop), rows)
        return None, True

    def _writes_done(self) -> list[tuple[int, int]]:
        """[seq_id, pages written] of background write-backs that finished;
        their rows go back here, on the rank's thread."""
        done = []
        for seq_id, (future, rows) in list(self.writes.items()):
            if future.done():
                del self.writes[seq_id]
                self.rt.rows.give_back(rows)
                try:
                    done.append((seq_id, future.result()))
                except Exception:
                    done.append((seq_id, 0))
        return done


def decode_rank_setup(options: RankOptions, engine) -> DecodeRanks:
    """`ParallelEngine(rank_setup=partial(decode_rank_setup, options))`."""
    return DecodeRanks(engine, options)
