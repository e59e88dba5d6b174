"""The prefill commands each rank runs (built inside the rank process).

Every rank runs the same command on the same batch; decisions that depend
on a rank's own state (pool hits, tier hits, staging room) are agreed with
`min_all`, so the ranks stay in step.
"""

from __future__ import annotations

import time

import numpy as np

from kvrelay.model.engine import Request
from kvrelay.model.page_export import export_prefix, import_prefix
from kvrelay.rpc import unpack_tokens
from kvrelay.rpc.worker_ops import HandleRef
from kvrelay.transfer import BlockHandle
from kvrelay.worker.protocol import pages_of, sampling
from kvrelay.worker.rank import TIER_WINDOW, RankOptions, RoleRanks
from kvrelay.worker.rank_ops import (
    Counters,
    DropHandles,
    PrefillBatch,
    PrefillItem,
    PrefillRan,
    RankCounters,
    RankPrefill,
    Refusal,
)


class PrefillRanks(RoleRanks):
    def __init__(self, engine, options: RankOptions) -> None:
        # lease id -> staging rows the published handle covers
        self.outstanding: dict[int, list[int]] = {}
        handlers = {PrefillBatch: self.prefill_batch, DropHandles: self.drop_handles}
        super().__init__(engine, options, handlers)

    def counters(self, _: Counters) -> RankCounters:
        self.sweep()  # rows of released or expired handles count as free
        return self.rt.counters(leases=len(self.outstanding))

    # -- staging rows held by published handles ----------------------------
    def sweep(self) -> int:
        """Returns the rows of handles released by their reader or expired."""

        async def ended() -> list[int]:
            leases = self.rt.agent.leases
            gone = [lid for lid in self.outstanding if not leases.is_active(lid)]
            for lid in gone:
                leases.release(lid)  # an expired lease is dropped here too
            return gone

        for lid in self.rt.run(ended()):
            self.rt.rows.give_back(self.outstanding.pop(lid))
        return self.rt.rows.free

    def drop_handles(self, message: DropHandles) -> None:
        """Ends this rank's leases among the handles (control went away before
        decode could read them) and takes their rows back."""
        mine = []
        for data in message.handles:
            handle = BlockHandle.from_bytes(data)
            if handle.agent_id == self.rt.agent.agent_id:
                mine.append(handle.lease_id)

        async def end() -> None:
            for lease_id in mine:
                self.rt.agent.leases.release(lease_id)

        self.rt.run(end())
        self.sweep()

    # -- the batch -----------------------------------------------------------
    def prefill_batch(self, message: PrefillBatch) -> PrefillRan:
        """Runs the leading requests of the batch that fit (pool and staging,
        all ranks agreeing); answers those run (the front keeps the others
        queued). A first request whose new pages exceed the whole staging
        arena is refused instead (it can never fit)."""
        self.sweep()
        pool, rows = self.engine.pool, self.rt.rows
        taken, states, pool_need = [], [], 0
        try:
            for item in message.items:
                tokens = unpack_tokens(item.tokens)
                pages = pages_of(len(tokens), self.ps)
                if not self.rt.agree(pool.free_pages >= pool_need + pages):
                    break
                state = self._lookup(tokens)
                if state.get("error"):
                    if not taken:  # answered; the front dequeues it
                        return PrefillRan(refused=state["error"])
                    break
                if not self.rt.agree(rows.free >= state["stage"] + state["draft_stage"]):
                    break  # the tier pages it imported stay cached for next time
                state["rows"] = rows.take(state["stage"])
                state["draft_rows"] = rows.take(state["draft_stage"])
                taken.append((item, tokens))
                states.append(state)
                pool_need += pages
            if not taken:
                return PrefillRan()
            looked_up = time.perf_counter()
            requests = [Request(tokens, sampling(item.params, max_new_tokens=1))
                        for item, tokens in taken]  # fmt: skip
            results = self.engine.generate(requests)
        except BaseException:
            for state in states:
                rows.give_back(state["rows"] + state["draft_rows"])
            raise
        computed = time.perf_counter()
        answers = [
            self._publish(item, tokens, state, result)
            for (item, tokens), state, result in zip(taken, states, results, strict=True)
        ]
        if not self.rt.options.local_cache:
            self.rt.clear_cache()
        for answer in answers:
            answer.timings["compute_s"] = computed - looked_up
        return PrefillRan(answers)

    def _lookup(self, tokens: list[int]) -> dict:
        """Pool prefix, then the tier's pages after it, pulled through a
        bounded window of staging rows and imported into the pool chunk by
        chunk. Ranks agree on both lengths. `stage`: the pages this request
        must stage for decode, those it cannot take from the tier."""
        started = time.perf_counter()
        # Computed once here; the publish and the tier writes reuse them.
        keys = self.engine.spec.page_keys(tokens)
        pages = pages_of(len(tokens), self.ps)
        # The last prompt token is always computed (its logits pick the first token).
        usable = min(len(keys), (len(tokens) - 1) // self.ps)
        pool = self.engine.pool
        local = 0
        if self.rt.options.local_cache:
            hit = pool.match_prefix(keys[:usable])
            pool.release(hit)
            local = self.rt.agree(len(hit))
        looked_up = time.perf_counter()
        tier = self._pull_tier(tokens, keys, local, usable)
        timings = {"lookup_s": looked_up - started, "tier_pull_s": time.perf_counter() - looked_up}
        # With the tier, decode takes [0, local + tier) from it (prefill's own
        # hits were written through when computed); without it, everything.
        start = local + tier if self.rt.cache is not None else 0
        stage = pages - start
        state = {"keys": keys, "local": local, "tier": tier, "start": start, "stage": stage}
        state |= {"rows": [], "draft_rows": [], "timings": timings}
        self._lookup_draft(tokens, state)
        fits = stage + state["draft_stage"] <= self.rt.rows.count
        if self.draft.enabled:  # only last-stage ranks stage draft pages: agree
            fits = self.rt.agree(fits)
        if not fits:
            state["error"] = Refusal("PoolExhausted", f"{stage} new pages to stage, "
                                     f"the staging arena holds {self.rt.rows.count}")  # fmt: skip
        return state

    def _lookup_draft(self, tokens, state: dict) -> None:
        """With speculation: the draft pages restored ahead of the target's
        cached prefix (pool, tier; the engine recomputes target pages past
        them), and the draft pages to stage: those of prompt + first token,
        (len(tokens) // page_size), from the first one the tier lacks."""
        state["draft_first"] = state["draft_stage"] = 0
        if not self.draft.enabled:
            return
        have = self.draft.lookup(tokens, state["local"] + state["tier"], TIER_WINDOW)
        first = have if self.rt.cache is not None else 0
        state["draft_first"] = first
        if self.draft.active:
            state["draft_stage"] = max(0, len(tokens) // self.ps - first)

    def _pull_tier(self, tokens, keys, local: int, usable: int) -> int:
        """Tier pages after `local`, through at most TIER_WINDOW staging rows
        at a time; returns the pages found (ranks agree)."""
        if self.rt.cache is None or usable <= local:
            return 0
        window = min(TIER_WINDOW, usable - local, self.rt.rows.free)
        if not self.rt.agree(window > 0):
            return 0
        rows = self.rt.rows.take(window)
        position = local
        # A view to slice per window in O(1) (a list slice copies the context).
        tokens = np.asarray(tokens)
        try:
            while position < usable:
                count = min(window, usable - position)
                hit = self.rt.tier_lookup(keys[position : position + count], rows[:count])
                if hit:
                    # Pages before `position` are cached (earlier windows): only
                    # this window's pages are read, matched and imported.
                    end = (position + hit) * self.ps
                    import_prefix(self.engine, tokens[:end], self.rt.staging, rows[:hit],
                                  chain=keys, first_page=position)  # fmt: skip
                position += hit
                if hit < count:
                    break
        finally:
            self.rt.rows.give_back(rows)
        return position - local

    def _publish(self, item: PrefillItem, tokens: list[int], state: dict, result) -> RankPrefill:
        """Export the pages decode cannot take from the tier (the new pages and
        the partial last page) into the staging rows, write the new full
        pages through to the tier, publish this rank's handle over them."""
        keys, rows = state["keys"], state["rows"]
        tier, start = state["tier"], state["start"]
        started = time.perf_counter()
        # `export_prefix` skips pages a CP rank does not own (page i: CP rank
        # i % cp); every CP rank computed and holds all of them.
        export_prefix(self.engine, tokens, self.rt.staging, rows, first_page=start, chain=keys)
        staged = time.perf_counter()
        owned = [i for i in range(start, start + len(rows)) if self.engine.parallel.owns_page(i)]
        full = len(keys)
        # Without the tier start is 0 and nothing is written. Pages before
        # `start` are already there (tier hits, or this worker's own pages,
        # written through when it computed them).
        new = [i for i in owned if i < full]
        written = self.rt.tier_write([keys[i] for i in new], [rows[i - start] for i in new])
        tier_pages = 0
        if self.rt.cache is not None:
            tier_pages = full if written else start
        first = result.tokens[0]
        finish = None
        if first in item.params.stop_token_ids:
            finish = "stop"
        elif item.params.max_new_tokens <= 1:
            finish = "length"
        pages = pages_of(len(tokens), self.ps)
        handle = None
        if self.rt.rect.writer and owned and finish is None:
            mine = [i - start for i in owned]
            data = self.rt.run(self._grant(rows, mine, item.lease_s))
            # The prompt's pages this handle holds: those after the cached
            # prefix, a CP rank's share of them; None for every page.
            held = None if len(owned) == pages else owned
            handle = HandleRef(data, [tuple(r) for r in self.rt.runs], held)
        else:  # a replica (or a CP rank owning no page) publishes nothing;
            # a finished request needs no decode
            self.rt.rows.give_back(rows)
        draft, lease = self.draft.publish(
            [*tokens, first], state["draft_first"], state["draft_rows"],
            item.lease_s, finished=finish is not None,
        )  # fmt: skip
        if lease is not None:
            self.outstanding[lease] = state["draft_rows"]
        tier_tokens = min(tier * self.ps, result.cached_tokens)
        state["timings"] |= {"stage_s": staged - started, "publish_s": time.perf_counter() - staged}
        return RankPrefill(
            first_token=first,
            finish_reason=finish,
            cached_local=result.cached_tokens - tier_tokens,
            cached_tier=tier_tokens,
            tier_pages=tier_pages,
            pages=pages,
            handle=handle,
            draft=draft,
            timings=state["timings"],
        )

    async def _grant(self, rows: list[int], owned: list[int], lease_s: float) -> bytes:
        # publish() touches the lease table: on the loop thread. The handle
        # covers the owned pages' rows; all the rows go back on its release.
        runs = self.rt.page_runs([rows[i] for i in owned])
        handle = self.rt.agent.publish(self.rt.arena, runs, self.rt.namespace, lease_s)
        self.outstanding[handle.lease_id] = rows
        return handle.to_bytes()


def prefill_rank_setup(options: RankOptions, engine) -> PrefillRanks:
    """`ParallelEngine(rank_setup=partial(prefill_rank_setup, options))`."""
    return PrefillRanks(engine, options)
