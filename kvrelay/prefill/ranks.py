"""The prefill commands each rank runs (built inside the rank process).

Every rank runs the same command on the same batch; decisions that depend
on a rank's own state (pool hits, tier hits, staging room) are agreed with
`min_all`, so the ranks stay in step.
"""

from __future__ import annotations

import time

from kvrelay.model.engine import Request
from kvrelay.model.transfer import export_prefix, import_prefix
from kvrelay.transfer import BlockHandle
from kvrelay.worker.protocol import pages_of, sampling
from kvrelay.worker.rank import RankOptions, RankRuntime


class PrefillRanks:
    def __init__(self, engine, options: RankOptions) -> None:
        self.rt = RankRuntime(engine, options)
        self.engine = engine
        self.ps = engine.spec.page_size
        # lease id -> staging rows the published handle covers
        self.outstanding: dict[int, list[int]] = {}

    def handlers(self) -> dict:
        return {
            "prefill_batch": self.prefill_batch,
            "sweep": self.sweep,
            "drop_handles": self.drop_handles,
            "counters": self.counters,
            "agent_address": lambda: self.rt.agent.address,
            "close": self.rt.close,
        }

    def counters(self) -> dict:
        self.sweep()  # rows of released or expired handles count as free
        return self.rt.counters() | {"leases": len(self.outstanding)}

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

    def drop_handles(self, handles: list[bytes]) -> int:
        """Ends this rank's leases among `handles` (control went away before
        decode could read them) and returns their rows."""
        mine = []
        for data in handles:
            handle = BlockHandle.from_bytes(data)
            if handle.agent_id == self.rt.agent.agent_id:
                mine.append(handle.lease_id)

        async def end() -> None:
            for lease_id in mine:
                self.rt.agent.leases.release(lease_id)

        self.rt.run(end())
        return self.sweep()

    # -- the batch -----------------------------------------------------------
    def prefill_batch(self, batch: list[dict]) -> list[dict]:
        """Runs the leading requests of `batch` that fit (pool and staging, all
        ranks agreeing); returns one answer per request run (the front keeps
        the others queued)."""
        self.sweep()
        pool, rows = self.engine.pool, self.rt.rows
        taken, pool_need, rows_need = [], 0, 0
        for item in batch:
            pages = pages_of(len(item["tokens"]), self.ps)
            fits = pool.free_pages >= pool_need + pages and rows.free >= rows_need + pages
            if not self.rt.agree(fits):
                break
            taken.append(item)
            pool_need += pages
            rows_need += pages
        if not taken:
            return []
        started = time.perf_counter()
        states: list[dict] = []
        try:
            for item in taken:
                states.append(self._lookup(item))
            looked_up = time.perf_counter()
            requests = [
                Request(item["tokens"], sampling(item["params"], max_new_tokens=1))
                for item in taken
            ]
            results = self.engine.generate(requests)
        except BaseException:
            for state in states:
                rows.give_back(state["rows"])
            raise
        computed = time.perf_counter()
        answers = [
            self._publish(item, state, result)
            for item, state, result in zip(taken, states, results, strict=True)
        ]
        if not self.rt.options.local_cache:
            self.rt.clear_cache()
        published = time.perf_counter()
        for answer in answers:
            answer["timings"] = {
                "lookup_s": looked_up - started,
                "compute_s": computed - looked_up,
                "publish_s": published - computed,
            }
        return answers

    def _lookup(self, item: dict) -> dict:
        """Pool prefix, then the tier's pages after it (pulled into staging rows
        and imported into the pool). Ranks agree on both lengths."""
        tokens = item["tokens"]
        keys = self.engine.spec.page_keys(tokens)
        # The last prompt token is always computed (its logits pick the first token).
        usable = min(len(keys), (len(tokens) - 1) // self.ps)
        pool = self.engine.pool
        local = 0
        if self.rt.options.local_cache:
            hit = pool.match_prefix(keys[:usable])
            pool.release(hit)
            local = self.rt.agree(len(hit))
        rows = self.rt.rows.take(pages_of(len(tokens), self.ps))
        tier = self.rt.tier_lookup(keys[local:usable], rows[local:usable])
        if tier:
            count = local + tier
            import_prefix(self.engine, tokens[: count * self.ps], self.rt.staging, rows[:count])
        return {"keys": keys, "rows": rows, "local": local, "tier": tier}

    def _publish(self, item: dict, state: dict, result) -> dict:
        """Export every page of the prompt into the staging rows, write new
        full pages through to the tier, publish this rank's handle."""
        tokens, keys, rows = item["tokens"], state["keys"], state["rows"]
        local, tier = state["local"], state["tier"]
        # Under CP each page is staged and written by its owner (page i: CP
        # rank i % cp) only; every CP rank computed and holds all of them.
        export_prefix(self.engine, tokens, self.rt.staging, rows)
        owned = [i for i in range(len(rows)) if self.engine.parallel.owns_page(i)]
        full = len(keys)
        new = [i for i in range(local) if i in owned] + [
            i for i in range(local + tier, full) if i in owned
        ]
        written = self.rt.tier_write([keys[i] for i in new], [rows[i] for i in new])
        # Pages decode may take from the tier; if a write failed, only what
        # the tier is known to hold (what decode cannot find there it takes
        # from the handles anyway).
        tier_pages = full if written else (tier if local == 0 else 0)
        if self.rt.cache is None:
            tier_pages = 0
        first = result.tokens[0]
        params = item["params"]
        finish = None
        if first in params.get("stop_token_ids", ()):
            finish = "stop"
        elif params["max_new_tokens"] <= 1:
            finish = "length"
        handle = None
        if self.rt.rect.writer and owned and finish is None:
            handle = self.rt.run(self._grant(rows, owned, float(item["lease_s"])))
        else:  # a replica (or a CP rank owning no page) publishes nothing;
            # a finished request needs no decode
            self.rt.rows.give_back(rows)
        tier_tokens = min(tier * self.ps, result.cached_tokens)
        return {
            "first_token": first,
            "finish_reason": finish,
            "cached_local": result.cached_tokens - tier_tokens,
            "cached_tier": tier_tokens,
            "tier_pages": tier_pages,
            "pages": len(rows),
            "handle": handle,
            "runs": [list(r) for r in self.rt.runs],
            # The prompt's pages this handle holds (all of them without CP).
            "page_indices": owned if self.engine.parallel.cp > 1 else None,
        }

    async def _grant(self, rows: list[int], owned: list[int], lease_s: float) -> bytes:
        # publish() touches the lease table: on the loop thread. The handle
        # covers the owned pages' rows; all the rows go back on its release.
        runs = self.rt.page_runs([rows[i] for i in owned])
        handle = self.rt.agent.publish(self.rt.arena, runs, self.rt.namespace, lease_s)
        self.outstanding[handle.lease_id] = rows
        return handle.to_bytes()


def prefill_rank_setup(options: RankOptions, engine) -> dict:
    """`ParallelEngine(rank_setup=partial(prefill_rank_setup, options))`."""
    return PrefillRanks(engine, options).handlers()
