"""Where a decode rank's prompt pages come from: the tier (through a window
of staging rows, or a row a page on the agent's loop) and the prefill
handles, each narrowed to this rank's rectangle. `decode.ranks` drives them."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np

from kvrelay.model.errors import RequestError
from kvrelay.model.page_export import import_prefix
from kvrelay.rpc.worker_ops import HandleRef
from kvrelay.transfer import BlockHandle, TransferError
from kvrelay.worker.handle_runs import overlap_reads
from kvrelay.worker.rank import TIER_WINDOW, RankRuntime


def held_pages(entry: HandleRef, pages: int) -> list[int]:
    """The prompt pages a prefill handle holds, in its order: its entry's
    `pages` (prefill sends them when it staged only some pages: those after
    its cached prefix, or a CP rank's share), else every page."""
    handle = BlockHandle.from_bytes(entry.handle)
    theirs = entry.runs
    held = entry.pages if entry.pages is not None else list(range(pages))
    if not all(p < pages for p in held):  # the message type checked p >= 0
        raise RequestError(f"a prefill handle's pages must be page indices in [0, {pages})")
    if not theirs or len(handle.runs) != len(held) * len(theirs):
        raise RequestError("a prefill handle's runs do not match its pages")
    return held


def staged_from(handles, pages: int) -> int:
    """The first page any prefill handle holds (pages before it were not
    staged: decode takes them from the tier or computes them)."""
    firsts = [min(held) for entry in handles if (held := held_pages(entry, pages))]
    return min(firsts, default=pages)


def pull_tier_windowed(rt: RankRuntime, tokens, keys, local: int, tier_end: int, free: int):
    """The tier's pages [local, tier_end), through at most TIER_WINDOW of
    the `free` staging rows at a time, imported into the pool window by
    window. Returns their pool pages, referenced (ranks agree on how
    many; the pages after the first one missing are not pulled)."""
    engine, ps = rt.engine, rt.spec.page_size
    window = min(TIER_WINDOW, tier_end - local, free)
    rows = rt.rows.take(window)
    pool, pulled, position = engine.pool, [], local
    # A view to slice per window in O(1) (a list slice copies the context).
    tokens = np.asarray(tokens)
    try:
        while position < tier_end:
            count = min(window, tier_end - position)
            hit = rt.tier_lookup(keys[position : position + count], rows[:count])
            if hit:
                end = (position + hit) * ps
                import_prefix(engine, tokens[:end], rt.staging, rows[:hit],
                              chain=keys, first_page=position)  # fmt: skip
                # References keep the window's pages while the next is imported.
                got = pool.match_prefix(keys[position : position + hit])
                kept = rt.agree(len(got))
                pool.release(got[kept:])
                pulled += got[:kept]
                position += kept
                if kept < hit:
                    break
            if hit < count:
                break
    except BaseException:
        pool.release(pulled)
        raise
    finally:
        rt.rows.give_back(rows)
    return pulled


async def pull_target(rt: RankRuntime, item, keys, local, pages, rows, tier_end) -> dict:
    """This rank's pages [local, pages): what the tier has of
    [local, tier_pages), the rest from the prefill handles, which cover
    only the pages prefill staged (those after its tier prefix). Pages
    neither gives (the tier lost some, or this worker has no tier) are
    recomputed by the engine at admission: `have` says where that starts."""
    tier = 0
    if rt.cache is not None and tier_end > local:
        tier = await rt.cache.lookup(
            keys[local:tier_end], rt.arena, rt.offsets(rows[: tier_end - local])
        )
    start, nbytes = local + tier, 0
    handles = [h for h in item.handles if not h.draft]
    staged = staged_from(handles, pages)
    if start < staged:  # a gap before what prefill staged: recompute from it
        return {"tier_pages": tier, "prefill_pages": 0, "bytes_from_prefill": 0, "have": start}
    if start < pages:
        nbytes = await read_from_prefill(rt, handles, start, pages, rows, local)
    return {
        "tier_pages": tier,
        "prefill_pages": pages - start,
        "bytes_from_prefill": nbytes,
        "have": pages,
    }


async def read_from_prefill(rt: RankRuntime, handles, start, pages, rows, local) -> int:
    """Each prefill writer's handle, narrowed to the overlap of its
    rectangle with this rank's, for pages [start, pages). A handle of a
    context-parallel prefill rank holds only the pages its `pages` lists."""
    reads, covered = [], [0] * (pages - start)
    for entry in handles:
        handle = BlockHandle.from_bytes(entry.handle)
        held = held_pages(entry, pages)
        remote, local_offsets = [], []
        for page, run, offset in overlap_reads(handle, entry.runs, held, rt.runs, start, pages):
            remote.append(run)
            local_offsets.append(rows[page - local] * rt.page_bytes + offset)
            covered[page - start] += run[1]
        if remote:
            reads.append((handle.narrow(remote), local_offsets))
    if any(n < rt.rect.num_bytes(rt.spec) for n in covered):
        raise RequestError("the prefill handles do not cover this rank's rectangle")
    # Coroutines only once every check passed: none is left unawaited.
    await asyncio.gather(*(
        rt.agent.read(h, rt.arena, offs, namespace=rt.namespace)
        for h, offs in reads))  # fmt: skip
    return sum(covered)


async def release_handles(agent, handles) -> None:
    """Releases prefill's leases on `handles`, best effort (a lease that is
    not released expires on its own)."""

    async def one(entry) -> None:
        with contextlib.suppress(TransferError, TimeoutError, OSError, ValueError):
            await agent.release_remote(BlockHandle.from_bytes(entry.handle), timeout=2.0)

    await asyncio.gather(*(one(entry) for entry in handles))
