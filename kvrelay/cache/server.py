"""The cache server: a CacheTier behind typed control frames, pages moved by the transfer engine.

The messages are `kvrelay.rpc.cache_ops` (hello -> `CacheWelcome` with the
page size and the transfer agent's address; then lookup, reserve, handle,
commit, release, stats, flush). A lookup or reservation that names the
caller's runs is answered with their handle too, and a commit may release
its reservation: a read or a write then takes two round trips, not three
or five. `lookup` and `reserve` may carry `ns`, the
namespace digest, recorded with each page so `flush` can drop one tenant's
pages. Each request is answered with its reply or a typed `Error`.

Tenants: the server admits tenant-scoped tokens as well as the cluster token
and checks every request against the connection's scope (`tenants.py`); page
keys are turned into per-namespace keys before they reach the tier.

The tier is single-threaded: every op runs on the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass

from kvrelay import rpc
from kvrelay.cache.arena import ArenaConfig, PageArena
from kvrelay.cache.eviction import DEFAULT_POLICY, POLICIES
from kvrelay.cache.identities import NamespaceBook
from kvrelay.cache.l3 import open_store
from kvrelay.cache.membership import NO_RING, ControlLink
from kvrelay.cache.policy import WritePolicy
from kvrelay.cache.slot_board import BOARD_SAFE, SlotBoard
from kvrelay.cache.tenants import check_every_namespace, check_namespace, tenant_keys
from kvrelay.cache.tier import CacheTier, TierConfig
from kvrelay.options import option
from kvrelay.rpc import MalformedMessage
from kvrelay.rpc.cache_ops import (
    Announce,
    AnnounceReply,
    CacheRequest,
    CacheStats,
    CacheStatsReply,
    CacheWelcome,
    Commit,
    CommitReply,
    Flush,
    FlushReply,
    GetRing,
    HandleReply,
    ListNamespaces,
    Lookup,
    LookupReply,
    NamespaceInfo,
    NamespacesReply,
    PublishHandle,
    ReleaseLease,
    ReleaseReply,
    Reserve,
    ReserveReply,
    RingReply,
    Touch,
    TouchReply,
)
from kvrelay.transfer import create_agent

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class CacheServerConfig:
    token: str = option(help="cluster token")
    page_bytes: int = option(help="bytes of one unified page (a slot)", minimum=1)
    arena_bytes: int = option(help="L2 host arena size in GiB", flag="--arena-gb", scale=GIB)
    listen: str = option("127.0.0.1:0", help="control address HOST:PORT")
    backend: str = option("tcp", help="transfer backend for page data", choices=["tcp", "ucx"])
    l3: str | None = option(
        None, help="file:DIR, valkey://HOST:PORT or valkey-cluster://HOST:PORT[,HOST:PORT...]"
    )
    l3_capacity_bytes: int | None = option(
        None, help="capacity of a file L3 in GiB", flag="--l3-gb", scale=GIB
    )
    # option() is a dataclasses.field: the enum member is the default itself.
    l3_policy: WritePolicy = option(WritePolicy.WRITE_BACK, help="when L3 gets pages")  # noqa: RUF009
    eviction: str = option(
        DEFAULT_POLICY, help="which L2 page goes first when the arena is full",
        choices=sorted(POLICIES),
    )  # fmt: skip
    timeout_s: float = option(
        10.0, help="hello deadline, frame stall limit, transfer deadline", positive=True
    )
    control: str | None = option(
        None, help="control URL: register, heartbeat, follow the ring, drain before leaving"
    )
    advertise: str | None = option(
        None, help="HOST:PORT clients reach this server at (default: the listen address)"
    )
    slot_board: bool = option(
        True, help="publish which slot holds which sealed page to same-host clients (shared memory)"
    )
    drain_grace_s: float = option(
        3.0,
        help="after leaving the ring, serve clients still on the old one this long",
        minimum=0.0,
    )


def _page_runs(runs: list[tuple[int, int]], page_bytes: int) -> list[tuple[int, int]]:
    for offset, length in runs:
        if offset + length > page_bytes:
            raise MalformedMessage(
                f"run {(offset, length)} is not inside a page of {page_bytes} bytes"
            )
    return runs


class CacheServer:
    def __init__(self, config: CacheServerConfig) -> None:
        self.config = config
        self.agent = None
        self.tier: CacheTier | None = None
        self.board: SlotBoard | None = None
        # lease id -> (namespace, tier keys in request order the lease covers).
        self._lease_keys: dict[int, tuple[bytes | None, list[bytes]]] = {}
        # tier lease id -> transfer leases of handles published under it.
        self._handle_leases: dict[int, list[int]] = {}
        self._server: rpc.Server | None = None
        self._ops = 0
        self.namespaces = NamespaceBook()
        self.address = ""
        self.control: ControlLink | None = None
        self._heartbeats: asyncio.Task | None = None

    async def start(self) -> CacheServer:
        c = self.config
        host, port = rpc.split_address(c.listen)
        self.agent = await create_agent(c.backend, token=c.token, host=host, timeout=c.timeout_s)
        arena = PageArena(self.agent, ArenaConfig(c.page_bytes, capacity_bytes=c.arena_bytes))
        l3 = open_store(c.l3, capacity_bytes=c.l3_capacity_bytes) if c.l3 else None
        self.tier = CacheTier(arena, l3, TierConfig(l3_policy=c.l3_policy, eviction=c.eviction))
        # Only where a same-host client can map the arena too (a memfd).
        if c.slot_board and arena.arena.shm_path and BOARD_SAFE:
            self.board = self.tier.index.board = SlotBoard(arena.num_slots)
        welcome = CacheWelcome(
            c.page_bytes, self.agent.address,
            self.board.path if self.board else None, self.board.size if self.board else 0,
        )  # fmt: skip
        self._server = rpc.Server(
            token=c.token,
            requests=CacheRequest,
            handler=self._handle,
            welcome=lambda: welcome,
            # A tenant's peer maps no arena (no memfd path), so no board either.
            scoped_welcome=lambda scope: CacheWelcome(c.page_bytes, self.agent.address),
            host=host,
            port=port,
            hello_timeout_s=c.timeout_s,
        )
        await self._server.start()
        self.address = self._server.address
        if c.control:
            self.control = ControlLink(c.control, c.token, c.advertise or self.address)
            self.control.on_new_ring = self._hand_off
            await self.control.register()
            self._heartbeats = asyncio.create_task(self.control.heartbeats())
        return self

    def _hand_off(self, ring) -> None:
        """A new ring may give some of this server's keys to another server, which
        looks for them in L3: write-back pages go there now. (The server cannot
        tell which keys moved: it holds per-namespace keys, the ring places the
        clients' keys.) With write-through they are there already."""
        if self.tier.l3 is not None:
            self.tier.demote_all()

    async def close(self) -> None:
        """Stop; a member of a cluster drains first: its sealed pages go to L3, it
        leaves the ring, and it serves clients still on the old ring (and requests
        in flight) for `drain_grace_s` before the listener closes."""
        l3 = self.tier.l3
        if self.control is not None:
            if l3 is not None:
                self.tier.demote_all()
            await self.control.drain()
            await asyncio.sleep(self.config.drain_grace_s)
        await self._server.close()
        if self._heartbeats is not None:
            self._heartbeats.cancel()
            await asyncio.gather(self._heartbeats, return_exceptions=True)
        if l3 is not None:
            # A graceful stop keeps write-back pages (also those written while
            # draining): a restart or the ring's next owner promotes them.
            self.tier.demote_all()
            l3.close()
        if self.control is not None:
            await self.control.deregister()
            await self.control.close()
        await self.agent.close()
        if self.board is not None:
            self.board.close()

    async def _handle(self, conn: rpc.Connection, request) -> rpc.Message:
        return self.handle(request, conn.scope)

    def handle(self, request, scope: rpc.Scope = rpc.EVERY_NAMESPACE) -> rpc.Message:
        """Answers one decoded request from a peer of `scope` (refusals raise: the
        server sends them typed)."""
        tier = self.tier
        self._ops += 1
        if self._ops % 256 == 0:
            self._forget_dead_leases()
        if isinstance(request, Lookup | Reserve | Commit | PublishHandle | Touch):
            check_namespace(scope, request.ns)
        if isinstance(request, Lookup | Reserve) and request.runs is not None:
            if request.ns is None:
                raise MalformedMessage("a handle needs the namespace (ns) of its pages")
            _page_runs(request.runs, self.config.page_bytes)
        if isinstance(request, Lookup):
            return self._lookup(request)
        if isinstance(request, Reserve):
            return self._reserve(request)
        if isinstance(request, PublishHandle):
            return HandleReply(
                self._publish(request.lease, request.count, request.runs, request.ns)
            )
        if isinstance(request, Commit):
            runs = _page_runs(request.runs, self.config.page_bytes)
            keys = tenant_keys(request.ns, request.keys)
            sealed = [tier.commit(k, runs) for k in keys]
            if request.release is not None:
                self._release(request.release, scope)
            return CommitReply(sealed)
        if isinstance(request, Touch):
            return TouchReply(tier.touch(tenant_keys(request.ns, request.keys)))
        if isinstance(request, ReleaseLease):
            return ReleaseReply(self._release(request.lease, scope))
        if isinstance(request, CacheStats):
            check_every_namespace(scope, "stats")
            l3 = dataclasses.asdict(tier.l3.stats) if tier.l3 is not None else None
            return CacheStatsReply(dataclasses.asdict(tier.stats), len(tier.index), l3)
        if isinstance(request, GetRing):
            ring = self.control.ring if self.control is not None else NO_RING
            return RingReply(ring.version, ring.servers)
        if isinstance(request, Announce):
            check_namespace(scope, request.ns)
            kept = self.namespaces.record(request.ns, request.identity)
            counts = self.namespaces.page_counts(tier.index.entries())
            near = self.namespaces.near(request.ns, scope.allows, counts)
            return AnnounceReply(kept, [NamespaceInfo(*n) for n in near])
        if isinstance(request, ListNamespaces):
            check_every_namespace(scope, "a list of namespaces")
            counts = self.namespaces.page_counts(tier.index.entries())
            return NamespacesReply([NamespaceInfo(*n) for n in self.namespaces.listing(counts)])
        if isinstance(request, Flush):
            if request.ns is None:
                check_every_namespace(scope, "a flush of every namespace")
            check_namespace(scope, request.ns)
            l2, l3 = tier.flush(request.ns)
            return FlushReply(l2, l3)
        raise MalformedMessage(f"a cache server does not serve {type(request).__name__}")

    def _lookup(self, request: Lookup) -> LookupReply:
        keys = tenant_keys(request.ns, request.keys)
        hit = self.tier.lookup(keys, request.lease_s, request.ns or b"")
        lease = hit.lease.lease_id if hit.lease else None
        handle = None
        if lease is not None:
            self._lease_keys[lease] = (request.ns, [e.key for e in hit.entries])
            if request.runs is not None:
                slots = [e.slot for e in hit.entries]
                handle = self._publish(lease, hit.hits, request.runs, request.ns, slots)
        return LookupReply(hit.hits, lease, hit.more, handle)

    def _reserve(self, request: Reserve) -> ReserveReply:
        keys = tenant_keys(request.ns, request.keys)
        slots, lease = self.tier.reserve(keys, request.lease_s, request.ns or b"")
        given = [k for k, s in zip(keys, slots, strict=True) if s is not None]
        self._lease_keys[lease.lease_id] = (request.ns, given)
        handle = None
        if request.runs is not None and given:
            given_slots = [s for s in slots if s is not None]
            handle = self._publish(
                lease.lease_id, len(given), request.runs, request.ns, given_slots
            )
        more = self.tier.refused_for_room(keys, slots)
        return ReserveReply(slots, lease.lease_id, more, handle)

    def _release(self, lease: int, scope: rpc.Scope) -> bool:
        known = self._lease_keys.get(lease)
        if known is None or not scope.allows(known[0]):
            # Another tenant's lease answers as an unknown one: nothing to learn.
            return False
        released = self.tier.release(lease)
        del self._lease_keys[lease]
        for handle_lease in self._handle_leases.pop(lease, []):
            self.agent.leases.release(handle_lease)
        return bool(released)

    def _forget_dead_leases(self) -> None:
        for lease in [lid for lid in self._lease_keys if self.tier.index.lease(lid) is None]:
            del self._lease_keys[lease]
            self._handle_leases.pop(lease, None)

    def _publish(
        self, lease: int, count: int, page_runs, ns: bytes | None, slots: list[int] | None = None
    ) -> bytes:
        """A block handle of `page_runs` of the first `count` pages of `lease`
        (`slots`: theirs, where the caller has them at hand)."""
        if ns is None:
            raise MalformedMessage("a handle needs the namespace (ns) of its pages")
        known_ns, keys = self._lease_keys.get(lease, (None, None))
        live = self.tier.index.lease(lease) if keys is not None else None
        if live is None or known_ns != ns:
            raise MalformedMessage(f"lease {lease!r} is unknown or expired")
        if not 1 <= count <= len(keys):
            raise MalformedMessage(f"count must be in [1, {len(keys)}]")
        page_runs = _page_runs(page_runs, self.config.page_bytes)
        arena = self.tier.arena
        if slots is None:
            slots = [self.tier.index.get(key).slot for key in keys[:count]]
        runs = arena.slot_runs(slots[:count], page_runs)
        # The handle lives as long as the pins that keep its slots from reuse.
        remaining = self.tier.index.seconds_left(live)
        handle = self.agent.publish(arena.arena, runs, ns, max(remaining, 0.001))
        self._handle_leases.setdefault(lease, []).append(handle.lease_id)
        return handle.to_bytes()
