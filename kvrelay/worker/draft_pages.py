"""Draft (MTP) pages in the serving path, one rank's share.

A worker whose engine speculates (its model has an MTP layer, `--speculative
K`) moves the draft's pages beside the target's: prefill pulls them from the
tier with the target's, stages the ones decode cannot take from the tier,
writes them through and publishes one more handle over them (`HandleRef.draft`);
decode takes them from its pool, the tier and that handle, and imports them
before admission. Draft page keys (`kvrelay.layout.draft_page_keys`) are in the
draft namespace, which is derived from the target's, so the tier stores them
beside the target's pages with no other change.

A draft page is one layer of the target's KV geometry, so it fits in a
staging row (rows are `target page_bytes`): the draft page of a row sits at
the row's start. Where the draft's page bytes divide the row, the staging
arena viewed as rows of the draft's page bytes gives the gather/scatter ops
their arena (row r is draft row r * stride); an MLA draft with indexer keys
need not divide it, and takes the rows' starts as a strided view. The
tier's slots are the target's page size; a draft page fills the start of one.

Only ranks of the last PP stage hold the MTP layer (`active`); the others
take no draft rows and contribute nothing but agreement. Everything here is
best effort: a draft page that is not restored is recomputed by the engine
at admission (its draft-miss rule), so tokens never depend on it; only the
work saved does.
"""

from __future__ import annotations

import asyncio

from kvrelay.cache.client import CacheClient, CacheClientConfig
from kvrelay.layout import draft_rectangle
from kvrelay.model.draft_transfer import draft_keys, export_draft_prefix, import_draft_prefix
from kvrelay.rpc.worker_ops import HandleRef
from kvrelay.transfer import BlockHandle
from kvrelay.worker.handle_runs import overlap_reads
from kvrelay.worker.rank import RankRuntime

# What a rank without the MTP layer contributes to a min-agreement on draft pages.
NO_LIMIT = 1 << 30


class DraftPages:
    def __init__(self, rt: RankRuntime) -> None:
        self.rt = rt
        self.engine = engine = rt.engine
        draft = engine.draft
        # Speculating at all (every rank knows), and holding the MTP layer here.
        self.enabled = draft is not None
        self.active = draft is not None and draft.pool is not None
        self.ps = engine.spec.page_size
        self.cache = None
        if not self.active:
            return
        self.spec = draft.spec
        self.rect = draft_rectangle(self.spec, engine.parallel)
        self.runs = self.rect.byte_runs(self.spec)
        self.namespace = self.spec.namespace()
        if self.spec.page_bytes > rt.page_bytes:
            raise ValueError("a draft page must fit in a target page's staging row")
        if rt.page_bytes % self.spec.page_bytes == 0:
            self.stride = rt.page_bytes // self.spec.page_bytes
            self.view = rt.staging.view(-1, self.spec.page_bytes)
        else:
            # An MLA draft whose indexer keys make it no divisor of the target
            # page: each row's start, viewed with the row's stride (the latent
            # page copy indexes any strided arena).
            self.stride = 1
            self.view = rt.staging[:, : self.spec.page_bytes]
        if rt.options.cache:
            config = CacheClientConfig(rt.options.cache, rt.options.token)
            self.cache = CacheClient(
                rt.agent, self.spec, self.rect, config, slot_bytes=rt.page_bytes
            )

    def keys(self, tokens: list[int]) -> list[bytes]:
        return draft_keys(self.engine, tokens) if self.active else []

    def _ids(self, rows: list[int]) -> list[int]:
        return [row * self.stride for row in rows]

    def pool_hits(self, keys: list[bytes]) -> list[int]:
        """Draft pool pages of the longest cached prefix of `keys` (referenced)."""
        return self.engine.draft.pool.match_prefix(keys) if self.active and keys else []

    def import_rows(self, tokens: list[int], count: int, first: int, rows: list[int]) -> None:
        """Index draft pages [0, count) of `tokens`: [first, count) from `rows`
        (one per page), the ones before already in the pool."""
        if not self.active or count <= first:
            return
        ids = [0] * first + self._ids(rows[: count - first])
        import_draft_prefix(self.engine, tokens[: count * self.ps + 1], self.view, ids)

    # -- prefill --------------------------------------------------------------------
    def lookup(self, tokens: list[int], upto: int, window: int) -> int:
        """Draft pages [0, have) of the prompt restored (pool, then the tier
        through at most `window` staging rows), have <= upto; ranks agree.
        Call on every rank of a speculating worker."""
        have = NO_LIMIT
        if self.active:
            keys = self.keys(tokens)[:upto]
            hit = self.pool_hits(keys)
            self.engine.draft.pool.release(hit)
            have = len(hit)
            count = min(len(keys) - have, window, self.rt.rows.free)
            if self.cache is not None and count > 0:
                rows = self.rt.rows.take(count)
                try:
                    offsets = self.rt.offsets(rows)
                    found = self.rt.run(
                        self.cache.lookup(keys[have : have + count], self.rt.arena, offsets)
                    )
                    self.import_rows(tokens, have + found, have, rows)
                    have += found
                finally:
                    self.rt.rows.give_back(rows)
        return self.rt.agree(have)

    def publish(
        self, tokens: list[int], first: int, rows: list[int], lease_s: float, finished: bool
    ):
        """Export draft pages [first, first + len(rows)) of `tokens` (prompt and
        first token) into `rows`, write them through, and publish a handle over
        them unless the request is `finished`. Returns (the draft handle or
        None, the handle's lease id or None); rows not under a handle are
        given back."""
        if not rows:
            return None, None
        export_draft_prefix(self.engine, tokens, self.view, self._ids(rows), first_page=first)
        # Under CP, draft page i is this rank's to write and publish if i % cp
        # is its CP rank (`export_draft_prefix` exported only those).
        mine = [i for i in range(len(rows)) if self.engine.parallel.owns_page(first + i)]
        keys = self.keys(tokens)
        if self.cache is not None and self.rect.writer and mine:
            offsets = self.rt.offsets([rows[i] for i in mine])
            written = [keys[first + i] for i in mine]
            self.rt.run(self.cache.write(written, self.rt.arena, offsets))
        if finished or not self.rect.writer or not mine:
            self.rt.rows.give_back(rows)
            return None, None

        async def grant():  # the lease table is touched on the loop thread
            offsets = self.rt.offsets([rows[i] for i in mine])
            runs = [(o + off, n) for o in offsets for off, n in self.runs]
            return self.rt.agent.publish(self.rt.arena, runs, self.namespace, lease_s)

        handle = self.rt.run(grant())
        pages = [first + i for i in mine]
        return HandleRef(handle.to_bytes(), list(self.runs), pages, draft=True), handle.lease_id

    # -- decode ---------------------------------------------------------------------
    async def pull(self, keys: list[bytes], first: int, rows: list[int], handles) -> dict:
        """Draft pages [first, len(keys)) into `rows`: the tier's prefix, then
        what prefill's draft handles hold, as far as they cover this rank's
        rectangle page by page. Returns {"tier", "prefill"} page counts; a
        failure counts as a miss (the engine recomputes from there)."""
        tier = prefill = 0
        todo = len(keys) - first
        try:
            if self.cache is not None and todo > 0:
                offsets = self.rt.offsets(rows[:todo])
                tier = await self.cache.lookup(keys[first:], self.rt.arena, offsets)
            start = first + tier
            if start < len(keys) and handles:
                prefill = await self._from_handles(handles, start, len(keys), first, rows)
        except Exception:  # a draft miss: recomputed at admission
            prefill = 0
        return {"tier": tier, "prefill": prefill}

    async def _from_handles(self, handles, start: int, end: int, first: int, rows) -> int:
        """Pages [start, stop) read from the draft handles, stop <= end the first
        page they do not wholly cover for this rank; returns stop - start."""
        need = self.rect.num_bytes(self.spec)
        plan: dict[int, list] = {}  # page -> [(handle, remote run, local offset)]
        for entry in handles:
            handle = BlockHandle.from_bytes(entry.handle)
            held = entry.pages or []
            if len(handle.runs) != len(held) * len(entry.runs):
                continue
            for page, remote, offset in overlap_reads(
                handle, entry.runs, held, self.runs, start, end
            ):
                local = rows[page - first] * self.rt.page_bytes + offset
                plan.setdefault(page, []).append((handle, remote, local))
        stop = start
        while stop < end and sum(r[1][1] for r in plan.get(stop, [])) >= need:
            stop += 1
        by_handle: dict[int, tuple] = {}
        for page in range(start, stop):
            for handle, remote, local in plan[page]:
                item = by_handle.setdefault(id(handle), (handle, [], []))
                item[1].append(remote)
                item[2].append(local)
        await asyncio.gather(*(
            self.rt.agent.read(h.narrow(remote), self.rt.arena, offs, namespace=self.namespace)
            for h, remote, offs in by_handle.values()))  # fmt: skip
        return stop - start

    async def close(self) -> None:
        if self.cache is not None:
            await self.cache.close()
