"""The decode commands each rank runs (built inside the rank process).

`load` brings a prompt's KV into the pool (pool hits, then the tier, then
the prefill handles, each rank only its rectangle) and admits the sequence
into the engine's running batch; `step` advances the batch one token;
`cancel` drops a sequence. Decisions that depend on a rank's own state are
agreed with `min_all`, so every rank raises the same error or none.
"""

from __future__ import annotations

import asyncio

from kvrelay.layout import rank_rectangle
from kvrelay.model.engine import Request
from kvrelay.model.errors import PoolExhausted, RequestError
from kvrelay.model.transfer import export_prefix, import_prefix
from kvrelay.transfer import BlockHandle, TransferError
from kvrelay.worker.protocol import pages_of, sampling
from kvrelay.worker.rank import PullFailed, RankOptions, RankRuntime


def intersect(mine, theirs) -> list[tuple[int, int, int]]:
    """(offset in page, length, index of their run) of each overlap of two run
    lists within one page object."""
    out = []
    for index, (t_off, t_len) in enumerate(theirs):
        for m_off, m_len in mine:
            start, end = max(m_off, t_off), min(m_off + m_len, t_off + t_len)
            if start < end:
                out.append((start, end - start, index))
    return out


class DecodeRanks:
    def __init__(self, engine, options: RankOptions) -> None:
        self.rt = RankRuntime(engine, options)
        self.engine = engine
        self.ps = engine.spec.page_size

    def handlers(self) -> dict:
        return {
            "load": self.load,
            "step": self.step,
            "cancel": self.engine.cancel,
            "counters": self.rt.counters,
            "close": self.rt.close,
        }

    # -- bringing the prompt's KV in ---------------------------------------------
    def load(self, item: dict) -> dict:
        tokens, first = item["tokens"], item["first_token"]
        keys = self.engine.spec.page_keys(tokens)
        pages = pages_of(len(tokens), self.ps)
        if item["pages"] != pages:
            raise RequestError(f"pages={item['pages']} but the prompt has {pages} pages")
        params = sampling(item["params"])
        request = Request(
            [*tokens, first],
            sampling(item["params"], max_new_tokens=params.max_new_tokens - 1),
            skip_draws=1,
        )
        pool = self.engine.pool
        hit = pool.match_prefix(keys) if self.rt.options.local_cache else []
        local = self.rt.agree(len(hit))
        try:
            # Pages of the whole sequence, plus one for the copy of the
            # partial page the admission makes.
            need = pages_of(len(tokens) + params.max_new_tokens - 1, self.ps) + 1 - local
            rows_need = pages - local
            fits = pool.free_pages >= need and self.rt.rows.free >= rows_need
            if not self.rt.agree(fits):
                raise PoolExhausted(need, pool.free_pages)
            rows = self.rt.rows.take(rows_need)
            try:
                pulled = self._pull(item, keys, local, pages, rows)
                ids = [rows[0]] * local + rows if rows else []
                if rows:
                    import_prefix(self.engine, tokens, self.rt.staging, ids)
            finally:
                self.rt.rows.give_back(rows)
            seq_id = self.engine.admit(request)
        finally:
            pool.release(hit)
        if not self.rt.options.local_cache:
            self.rt.clear_cache()
        return {"seq_id": seq_id, "local_pages": local, **pulled}

    def _pull(self, item, keys, local, pages, rows) -> dict:
        full = len(keys)
        tier_end = max(local, min(int(item["tier_pages"]), full))
        tier = self.rt.tier_lookup(keys[local:tier_end], rows[: tier_end - local])
        start = local + tier
        ok, why, nbytes = 1, "", 0
        if start < pages:
            try:
                nbytes = self.rt.run(self._from_prefill(item["handles"], start, pages, rows, local))
            except (TransferError, RequestError, TimeoutError, ValueError) as exc:
                ok, why = 0, f"{type(exc).__name__}: {exc}"
        # Also a barrier: every rank has finished reading before rank 0 releases.
        if not self.rt.agree(ok):
            raise PullFailed(why or "another rank failed to pull its pages from prefill")
        if self.engine.parallel.rank == 0:
            self.rt.run(self._release(item["handles"]))
        return {
            "tier_pages": tier,
            "prefill_pages": pages - start,
            "bytes_from_prefill": nbytes,
        }

    async def _from_prefill(self, handles, start, pages, rows, local) -> int:
        """Each prefill writer's handle, narrowed to the overlap of its
        rectangle with this rank's, for pages [start, pages)."""
        pb = self.rt.page_bytes
        reads, covered = [], 0
        for entry in handles:
            handle = BlockHandle.from_bytes(entry["handle"])
            theirs = [tuple(r) for r in entry["runs"]]
            if not theirs or len(handle.runs) != pages * len(theirs):
                raise RequestError("a prefill handle's runs do not match its pages")
            overlap = intersect(self.rt.runs, theirs)
            if not overlap:
                continue
            remote, local_offsets = [], []
            for page in range(start, pages):
                row_base = handle.runs[page * len(theirs)][0] - theirs[0][0]
                for offset, length, _ in overlap:
                    remote.append((row_base + offset, length))
                    local_offsets.append(rows[page - local] * pb + offset)
            covered += sum(length for _, length, _ in overlap)
            reads.append(
                self.rt.agent.read(
                    handle.narrow(remote), self.rt.arena, local_offsets,
                    namespace=self.rt.namespace,
                )
            )  # fmt: skip
        if covered < self.rt.rect.num_bytes(self.rt.spec):
            raise RequestError("the prefill handles do not cover this rank's rectangle")
        await asyncio.gather(*reads)
        return covered * (pages - start)

    async def _release(self, handles) -> None:
        for entry in handles:
            try:
                handle = BlockHandle.from_bytes(entry["handle"])
                await self.rt.agent.release_remote(handle, timeout=2.0)
            except (TransferError, TimeoutError, OSError):
                pass  # the lease expires on its own

    # -- generation ----------------------------------------------------------------
    def step(self) -> list[dict]:
        out = []
        for output in self.engine.step():
            written = None
            if output.finish_reason is not None and self.rt.options.write_back:
                written = self._write_back(output.all_tokens)
            out.append(
                {
                    "seq_id": output.seq_id,
                    "tokens": output.tokens,
                    "finish_reason": output.finish_reason,
                    "written": written,
                }
            )
        return out

    def _write_back(self, tokens: list[int]) -> int | None:
        """Full pages of a finished sequence (prompt and answer) to the tier;
        None on a rank that writes nothing (a replica)."""
        if self.rt.cache is None or not rank_rectangle(self.rt.spec, self.engine.parallel).writer:
            return None
        full = (len(tokens) - 1) // self.ps
        if not full or self.rt.rows.free < full:
            return 0
        rows = self.rt.rows.take(full)
        try:
            export_prefix(self.engine, tokens[: full * self.ps], self.rt.staging, rows)
            keys = self.rt.spec.page_keys(tokens[: full * self.ps])
            return self.rt.run(self.rt.cache.write(keys, self.rt.arena, self.rt.offsets(rows)))
        finally:
            self.rt.rows.give_back(rows)


def decode_rank_setup(options: RankOptions, engine) -> dict:
    """`ParallelEngine(rank_setup=partial(decode_rank_setup, options))`."""
    return DecodeRanks(engine, options).handlers()
