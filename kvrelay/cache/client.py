"""The worker side of the cache tier: find, pull and write pages of one rank's rectangle.

Pages are placed on servers by `HashRing` over their keys, so each call
splits its keys per server and talks to those servers concurrently. The ring
starts as the configured list and follows the versions control publishes
(`RingFollower`); calls already begun finish on the ring they started with. A server
that is down, slow or refusing counts as misses (lookups) or as pages not
written (writes): the tier never fails a request.

Local memory is a transfer `Arena` of the caller's agent in which page i of a
call sits in unified-page layout at `page_offsets[i]`; only the caller's
rectangle of each page is moved.

Writes follow `write_policy`: `write-through` (default) pushes in `write()`;
`write-back` copies the rectangles into the client's `WriteBackQueue` and a
background task pushes them once `write_back_batch` pages wait or
`write_back_delay_s` after the first was queued, so the request is not slowed
by the network. `flush()` pushes everything now and `close()` flushes first,
so a clean close loses nothing. Waiting pages also answer this client's own
lookups, past the servers' prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from kvrelay import aio
from kvrelay.cache.client_config import CacheClientConfig, ClientStats
from kvrelay.cache.identities import IdentityNotes
from kvrelay.cache.page_movers import ArenaPages, PageMover
from kvrelay.cache.policy import WritePolicy
from kvrelay.cache.ring_follow import RingFollower
from kvrelay.cache.writeback import WriteBackQueue
from kvrelay.layout import HashRing, ModelKVSpec, Rectangle, prefix_in_turns, ring_prefix
from kvrelay.rpc import Unavailable
from kvrelay.rpc.cache_ops import (
    CacheStats,
    CacheStatsReply,
    CacheWelcome,
    Commit,
    CommitReply,
    Flush,
    FlushReply,
    HandleReply,
    Lookup,
    LookupReply,
    PublishHandle,
    ReleaseLease,
    ReleaseReply,
    Reserve,
    ReserveReply,
)
from kvrelay.transfer import Agent, Arena, BlockHandle, TransferError


class CacheClient:
    def __init__(
        self,
        agent: Agent,
        spec: ModelKVSpec,
        rect: Rectangle,
        config: CacheClientConfig,
        slot_bytes: int | None = None,
    ) -> None:
        self.agent = agent
        self.spec = spec
        # The servers' slot size: a page's own size, or a larger one whose
        # start it fills (draft pages share the target's tier).
        self.slot_bytes = spec.page_bytes if slot_bytes is None else slot_bytes
        if self.slot_bytes < spec.page_bytes:
            raise ValueError(f"slots of {self.slot_bytes} bytes cannot hold {spec.page_bytes}")
        self.rect = rect
        self.config = config
        self.runs = rect.byte_runs(spec)
        # A page smaller than its slot: every writer also marks the slot's
        # tail written (nothing reads it), so the slot seals with the page.
        tail = self.slot_bytes - spec.page_bytes
        self._commit_runs = self.runs + ([(spec.page_bytes, tail)] if tail else [])
        self.namespace = spec.namespace()
        self.stats = ClientStats()
        self.follower = RingFollower(
            config.servers, config.token, config.timeout_s, self._check_welcome,
            config.ring_poll_s,
        )  # fmt: skip
        # Every server ever on a ring: calls begun on an old ring finish on it.
        self._servers = self.follower.channels
        self._queue: WriteBackQueue | None = None
        self._pusher: asyncio.Task | None = None
        self._queued = asyncio.Event()  # a page waits
        self._batch_ready = asyncio.Event()  # write_back_batch pages wait, or the queue is full
        self._push_lock = asyncio.Lock()
        self.notes = IdentityNotes(spec)  # what servers said of this namespace

    @property
    def ring(self) -> HashRing:
        return self.follower.ring

    @property
    def ring_version(self) -> int:
        return self.follower.version

    def set_ring(self, version: int, servers: Sequence[str]) -> bool:
        """Move to ring `version` if it is newer (calls already begun keep theirs)."""
        return self.follower.set(version, servers)

    async def refresh_ring(self) -> bool:
        """Ask the servers for the ring control published; move to it when newer."""
        return await self.follower.refresh()

    def _follow_ring(self) -> None:
        self.follower.follow()

    def _check_welcome(self, welcome: CacheWelcome) -> str | None:
        if welcome.page_bytes != self.slot_bytes:
            return self.notes.refused(welcome.page_bytes, self.slot_bytes)
        return None

    async def close(self) -> None:
        """Push what waits (write-back), then drop connections and the staging arena."""
        if self._queue is not None:
            await self.flush()
            self._pusher.cancel()
            results = await asyncio.gather(self._pusher, return_exceptions=True)
            self._queue.close()
            self._queue = None
            if isinstance(results[0], Exception):
                raise results[0]
        await self.follower.close()

    def _mover(self, local: Arena | PageMover, page_offsets) -> PageMover:
        if isinstance(local, Arena):
            if page_offsets is None:
                raise ValueError("pages in an arena need their page offsets")
            return ArenaPages(local, page_offsets)
        return local

    async def lookup(
        self,
        keys: Sequence[bytes],
        dest: Arena | PageMover,
        page_offsets: Sequence[int] | None = None,
    ) -> int:
        """Pull this rank's rectangle of the longest cached prefix of `keys`; return its length.

        `dest`: an arena holding page i at `page_offsets[i]`, or a `PageMover`
        that places the pages itself."""
        mover = self._mover(dest, page_offsets)
        self._follow_ring()
        ring = self.ring
        self.stats.lookups += 1
        self.stats.lookup_pages += len(keys)
        prefix = await prefix_in_turns(
            len(keys),
            lambda start: self._lookup_round(ring, keys[start:], mover.shifted(start)),
        )
        if prefix < 0:  # a pull failed midway: which pages arrived is unknown
            self.stats.errors += 1
            return 0
        # Pages this client wrote back but has not pushed yet continue the prefix.
        if self._queue is not None and isinstance(dest, Arena):
            while prefix < len(keys) and self._queue.copy_out(
                keys[prefix], dest, page_offsets[prefix]
            ):
                prefix += 1
                self.stats.queue_hit_pages += 1
        self.stats.hit_pages += prefix
        return prefix

    async def _lookup_round(
        self, ring: HashRing, keys: Sequence[bytes], dest: PageMover | None
    ) -> tuple[int, bool]:
        """One lookup of `keys` on their servers and, with `dest`, the pulls of
        the prefix found: (its length, or -1 if a pull failed; whether the
        server that ended it may hold more)."""
        groups = ring.group(keys)
        pulling = dest is not None
        answers = await aio.gather(
            *(self._lookup_one(s, [keys[p] for p in ps], pulling) for s, ps in groups.items())
        )
        found = dict(zip(groups, answers, strict=True))
        prefix, taken = ring_prefix(ring, keys, {s: a[0] for s, a in found.items()})
        pulls = [
            self._pull(server, found[server], positions[: taken[server]], dest)
            for server, positions in groups.items()
            if pulling and taken[server]
        ]
        results = await aio.gather(*pulls, return_exceptions=True)
        await self._release_all([(s, a[1]) for s, a in found.items() if a[1] is not None])
        if any(isinstance(r, BaseException) for r in results):
            return -1, False
        return prefix, prefix < len(keys) and found[ring.server_for(keys[prefix])][2]

    async def _lookup_one(
        self, server: str, keys: list[bytes], pulling: bool
    ) -> tuple[int, int | None, bool, bytes | None]:
        """(hits, lease, more, the hits' handle when `pulling`)."""
        await self.notes.announce(server, self._servers[server])
        runs = self.runs if pulling else None
        try:
            reply = await self._servers[server].call(
                Lookup(keys, self.config.lease_s, self.namespace, runs), LookupReply
            )
        except Unavailable:
            self.stats.errors += 1
            return 0, None, False, None
        return reply.hits, reply.lease, reply.more, reply.handle

    async def count_prefix(self, keys: Sequence[bytes]) -> int:
        """Length of the sealed prefix of `keys` in the tier, moving no page bytes
        (lookups whose pins are released at once; a server down counts as misses)."""
        self._follow_ring()
        ring = self.ring
        return await prefix_in_turns(
            len(keys), lambda start: self._lookup_round(ring, keys[start:], None)
        )

    async def _pull(self, server, answer, positions, dest: PageMover) -> None:
        _, lease, _, raw = answer
        handle = await self._handle(server, lease, len(positions), raw)
        await dest.pull(self, handle, positions)
        self.stats.bytes_in += len(positions) * self.rect.num_bytes(self.spec)

    async def _handle(self, server, lease: int, count: int, raw: bytes | None) -> BlockHandle:
        """The handle of the first `count` pages of `lease`: `raw` (published for
        all of its pages with the lookup or reservation) narrowed, or asked for."""
        if raw is None:  # a server that does not publish with lookups
            ask = PublishHandle(lease, count, self.runs, self.namespace)
            raw = (await self._servers[server].call(ask, HandleReply)).handle
        return self.pages_handle(raw, count)

    def pages_handle(self, raw: bytes, count: int) -> BlockHandle:
        """A published handle narrowed to this client's runs of its first `count` pages."""
        handle = BlockHandle.from_bytes(raw)
        wanted = count * len(self.runs)
        if len(handle.runs) < wanted:
            raise TransferError(f"a handle of {len(handle.runs)} runs for {wanted}")
        if len(handle.runs) > wanted:
            handle = handle.narrow(handle.runs[:wanted])
        return handle

    async def write(
        self,
        keys: Sequence[bytes],
        src: Arena | PageMover,
        page_offsets: Sequence[int] | None = None,
    ) -> int:
        """Write this rank's rectangle of full pages `keys` (from an arena holding
        page i at `page_offsets[i]`, or a `PageMover` that fills slots itself).

        Write-through: pushes now and returns how many pages went in (not
        those already sealed there). Write-back: copies them into the queue
        and returns how many it took (the rest are dropped: the queue is full).
        A page seals on its server when every writer rectangle is in. Replica
        ranks that do not write (`rect.writer` False) write nothing.
        """
        if page_offsets is not None and len(page_offsets) != len(keys):
            raise ValueError(f"{len(page_offsets)} page offsets for {len(keys)} keys")
        if not self.rect.writer or not keys:
            return 0
        if self.config.write_policy is WritePolicy.WRITE_BACK:
            if not isinstance(src, Arena):
                raise ValueError("write-back copies pages from an arena, not a PageMover")
            return self._enqueue(keys, src, page_offsets)
        written, _ = await self._push(keys, self._mover(src, page_offsets))
        return written

    async def flush(self) -> int:
        """Push every page the write-back queue holds now; return how many went in."""
        if self._queue is None:
            return 0
        async with self._push_lock:
            keys = list(self._queue.pending)
            if not keys:
                return 0
            offsets = [self._queue.local_offsets(k) for k in keys]
            queued = ArenaPages(self._queue.arena, run_offsets=offsets)
            written, failed = await self._push(keys, queued)
            self._queue.remove(keys)
            self.stats.dropped_pages += failed
            self.stats.pending_pages = len(self._queue)
            return written

    def _enqueue(self, keys: Sequence[bytes], src: Arena, page_offsets: Sequence[int]) -> int:
        if self._queue is None:
            self._queue = WriteBackQueue(self.agent, self.config.write_back_pages, self.runs)
            self._pusher = asyncio.get_running_loop().create_task(self._push_loop())
        taken = 0
        for key, offset in zip(keys, page_offsets, strict=True):
            if not self._queue.add(key, src, offset):
                break
            taken += 1
        self.stats.queued_pages += taken
        self.stats.dropped_pages += len(keys) - taken
        self.stats.pending_pages = len(self._queue)
        if taken:
            self._queued.set()
        if len(self._queue) >= self.config.write_back_batch or self._queue.full:
            self._batch_ready.set()
        return taken

    async def _push_loop(self) -> None:
        while True:
            await self._queued.wait()
            if not self._batch_ready.is_set():
                # Let a batch gather, but push the first page within the delay.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.config.write_back_delay_s):
                        await self._batch_ready.wait()
            self._queued.clear()
            self._batch_ready.clear()
            await self.flush()

    async def _push(self, keys: Sequence[bytes], src: PageMover) -> tuple[int, int]:
        """Push the pages `keys` from `src`; return (pages in, pages failed)."""
        self._follow_ring()
        groups = self.ring.group(keys)
        results = await aio.gather(*(self._write_one(s, ps, keys, src) for s, ps in groups.items()))
        written = sum(w for w, _ in results)
        self.stats.written_pages += written
        return written, sum(f for _, f in results)

    async def _write_one(self, server, positions, keys, src: PageMover) -> tuple[int, int]:
        """Reserve, fill and commit this server's pages; (written, failed).
        In turns while the server refuses some for want of room it can make
        (its L3 takes what L2 must let go): a prompt longer than L2 is kept."""
        await self.notes.announce(server, self._servers[server])
        conn = self._servers[server]
        written, positions = 0, list(positions)
        while positions:
            lease = None
            try:
                mine = [keys[p] for p in positions]
                reply = await conn.call(
                    Reserve(mine, self.config.lease_s, self.namespace, self.runs), ReserveReply
                )
                lease = reply.lease
                slots = reply.slots
                todo = [p for p, slot in zip(positions, slots, strict=True) if slot is not None]
                if todo:
                    handle = await self._handle(server, lease, len(todo), reply.handle)
                    await src.push(self, handle, todo)
                    await conn.call(
                        Commit([keys[p] for p in todo], self._commit_runs, self.namespace, lease),
                        CommitReply,
                    )
                    lease = None  # released by the commit
                    self.stats.bytes_out += len(todo) * self.rect.num_bytes(self.spec)
                    written += len(todo)
            except (Unavailable, TransferError):
                self.stats.errors += 1
                return written, len(positions)
            finally:
                if lease is not None:
                    await self._release_all([(server, lease)])
            if not (todo and reply.more):
                break
            positions = [p for p, slot in zip(positions, slots, strict=True) if slot is None]
        return written, 0

    async def server_stats(self) -> dict[str, dict | None]:
        """Each server's tier and L3 statistics (evictions, demotions, promotions,
        checksum failures, ...); None for a server that did not answer."""

        async def one(server: str) -> dict | None:
            try:
                reply = await self._servers[server].call(CacheStats(), CacheStatsReply)
            except Unavailable:
                return None
            return {"tier": reply.tier, "pages": reply.pages} | (
                {"l3": reply.l3} if reply.l3 else {}
            )

        servers = self.ring.servers
        replies = await asyncio.gather(*(one(s) for s in servers))
        return dict(zip(servers, replies, strict=True))

    async def admin_flush(self, namespace: bytes | None = None) -> dict[str, dict | None]:
        """Drop one namespace's pages (None: every page) from every server's L2 and L3;
        per server `{"dropped", "l3_dropped"}`, None for a server that did not answer."""

        async def one(server: str) -> dict | None:
            try:
                reply = await self._servers[server].call(Flush(namespace), FlushReply)
            except Unavailable:
                return None
            return {"dropped": reply.dropped, "l3_dropped": reply.l3_dropped}

        servers = self.ring.servers
        replies = await asyncio.gather(*(one(s) for s in servers))
        return dict(zip(servers, replies, strict=True))

    async def _release_all(self, leases: list[tuple[str, int]]) -> None:
        # Posted, not called: nothing waits on a release, and a lost one
        # only keeps pages pinned until the lease expires.
        for server, lease in leases:
            await self._servers[server].post(ReleaseLease(lease), ReleaseReply)
