"""The transfer agent: arenas, handles, leases, peers, the control server.

An agent owns arenas and publishes block handles for byte runs of them;
other agents pull (read) or push (write) those runs. Everything but moving
the bytes is here and common to every backend: the control server (hello with
the cluster token, the arena table, lease release), validation of handles
before any byte moves, coalescing of runs, the same-host fast path, deadlines,
and dropping a failed peer so nothing stays registered for it.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import uuid
from collections.abc import Sequence

import numpy as np

from kvrelay import rpc
from kvrelay.rpc.agent_ops import (
    AgentRequest,
    AgentWelcome,
    ArenaInfo,
    Arenas,
    ArenaTable,
    Release,
)
from kvrelay.transfer.arena import Arena
from kvrelay.transfer.base import AgentConfig, Peer, Transport
from kvrelay.transfer.calibrate import FAST_COPIES, CopyPlan, copy_plan, fast_copy_plan
from kvrelay.transfer.errors import (
    AuthError,
    PeerError,
    ProtocolError,
    TransferError,
    TransferTimeout,
    UnknownArena,
)
from kvrelay.transfer.fastpath import copy_shared, host_id
from kvrelay.transfer.handle import BlockHandle, Runs, check_runs, plan_rows, rows_array
from kvrelay.transfer.inline import InlineBudget
from kvrelay.transfer.lease import LeaseTable
from kvrelay.transfer.mapped_copies import MappedCopies


class Agent(MappedCopies):
    def __init__(self, config: AgentConfig, transport: Transport) -> None:
        if not config.token:
            raise ValueError("an agent needs a non-empty cluster token")
        if config.fast_copy not in FAST_COPIES:
            raise ValueError(f"fast_copy must be one of {FAST_COPIES}, not {config.fast_copy!r}")
        if config.stripes not in (0, 1, 2):
            raise ValueError(f"stripes must be 0 (as measured), 1 or 2, not {config.stripes!r}")
        self.config = config
        self.transport = transport
        self.agent_id = uuid.uuid4().bytes
        self.host_id = host_id()
        self.leases = LeaseTable()
        self.arenas: dict[int, Arena] = {}
        self._arena_ids = itertools.count(1)
        self._peers: dict[str, Peer] = {}
        self._server: rpc.Server | None = None
        self.address = ""
        self.copy_plan: CopyPlan | None = None  # the fast path's, set by start()
        self._inline = InlineBudget()  # the fast path's inline copies

    # -- lifecycle ------------------------------------------------------------
    async def start(self) -> Agent:
        calibrated = None
        if (
            self.config.fast_path and self.config.fast_copy == "calibrated"
        ) or self.transport.wants_copy_plan(self.config):
            # Measured once per boot and cached (about half a second the first time).
            calibrated = await asyncio.to_thread(copy_plan)
        if self.config.fast_path:
            forced = self.config.fast_copy != "calibrated"
            self.copy_plan = fast_copy_plan(self.config.fast_copy) if forced else calibrated
        self.transport.tune(self.config, calibrated)
        self._server = rpc.Server(
            token=self.config.token,
            requests=AgentRequest,
            handler=self._handle,
            welcome=self._welcome,
            # Tenant-scoped peers only where every byte they move is checked
            # against a lease of their namespace (no rkey, no mapping).
            scoped_welcome=self._scoped_welcome if self.transport.lease_bounded else None,
            host=self.config.host,
            port=self.config.port,
            hello_timeout_s=self.config.timeout,
        )
        await self._server.start()
        self.address = self._server.address
        return self

    async def close(self) -> None:
        """Ordered teardown: peers (rkeys, endpoints, mappings), server, arenas, backend."""
        for peer in list(self._peers.values()):
            self._drop_peer(peer)
        if self._server is not None:
            await self._server.close()
        for arena in list(self.arenas.values()):
            # Peers saw the control connection close, so they stop using it.
            self.free_arena(arena, force=True)
        self.transport.close()

    async def __aenter__(self) -> Agent:
        return self if self.address else await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # -- arenas, handles, leases ---------------------------------------------
    def allocate_arena(self, size: int, *, shared: bool | None = None) -> Arena:
        """A new zeroed host arena; shared memory (fast-path capable) by default."""
        if size <= 0:
            raise ValueError(f"arena size must be positive, got {size}")
        shared = self.config.fast_path if shared is None else shared
        arena_id = next(self._arena_ids)
        arena = (Arena.allocate_shared if shared else Arena.allocate_private)(arena_id, size)
        return self._register(arena)

    def register_tensor(self, tensor) -> Arena:
        """Registers a caller's contiguous tensor (which must hold only KV pages).
        GPU tensors go only to a backend that moves device memory (ucx)."""
        if tensor.is_cuda and not self.transport.device_memory:
            raise ValueError(f"the {self.transport.name} backend moves host memory only")
        arena = Arena.wrap(next(self._arena_ids), tensor)
        arena.kernel_copy = self.config.fast_path and not tensor.is_cuda
        return self._register(arena)

    def _register(self, arena: Arena) -> Arena:
        try:
            arena.rkey = self.transport.register(arena)
        except BaseException:
            arena.close()
            raise
        self.arenas[arena.arena_id] = arena
        return arena

    def free_arena(self, arena: Arena, *, force: bool = False) -> None:
        """Unregisters and releases an arena. Refused while unexpired leases name
        it: readers holding its handles could otherwise reach memory reused for
        something else (cma reads any address of this process)."""
        self.leases.sweep()
        if not force and self.leases.count_for(arena.arena_id):
            raise TransferError(f"arena {arena.arena_id} still has active leases")
        if self.arenas.pop(arena.arena_id, None) is not None:
            self.transport.deregister(arena)
            arena.close()

    def arena_table(self, scope: rpc.Scope = rpc.EVERY_NAMESPACE) -> list[ArenaInfo]:
        """The arenas as peers see them; a tenant-scoped peer gets no rkey and no
        memory to map or read by pid, only what its leases let it move through
        the owner."""
        every = scope.every_namespace
        pid = os.getpid()
        return [
            ArenaInfo(a.arena_id, a.address, a.size, a.rkey if every else b"",
                      a.shm_path if every else "",
                      pid if every and a.kernel_copy else 0)
            for a in self.arenas.values()
        ]  # fmt: skip

    def publish(
        self,
        arena: Arena,
        runs: Sequence[tuple[int, int]],
        namespace: bytes,
        lease_seconds: float | None = None,
    ) -> BlockHandle:
        """A handle for `runs` of `arena` under a new lease: (offset, length)
        pairs, or an (n, 2) uint64 array (a batch's runs, kept as an array)."""
        if self.arenas.get(arena.arena_id) is not arena:
            raise UnknownArena(f"arena {arena.arena_id} is not registered with this agent")
        if isinstance(runs, np.ndarray):
            array = check_runs(runs, arena.size, "published")
            runs = Runs(array.astype("<u8", copy=False).tobytes())
        else:
            runs = tuple((int(o), int(n)) for o, n in runs)
            array = check_runs(runs, arena.size, "published")
        lease = self.leases.grant(
            arena.arena_id, runs, lease_seconds or self.config.lease_seconds, namespace
        )
        handle = BlockHandle(
            backend=self.transport.name,
            agent=self.address,
            agent_id=self.agent_id,
            arena_id=arena.arena_id,
            rkey=arena.rkey,
            base=arena.address,
            runs=runs,
            lease_id=lease.lease_id,
            lease_expiry=lease.expiry,
            namespace=bytes(namespace),
        )
        object.__setattr__(handle, "_array", array)
        return handle

    # -- moving bytes ----------------------------------------------------------
    async def read(self, handle, local: Arena, local_offsets, *, namespace, timeout=None):
        """Pulls the handle's runs into `local` at `local_offsets` (one per run)."""
        await self._transfer(handle, local, local_offsets, namespace, timeout, read=True)

    async def write(self, handle, local: Arena, local_offsets, *, namespace, timeout=None):
        """Pushes `local` at `local_offsets` into the handle's runs (e.g. a cache slot)."""
        await self._transfer(handle, local, local_offsets, namespace, timeout, read=False)

    async def _transfer(self, handle, local, local_offsets, namespace, timeout, *, read):
        if not isinstance(handle, BlockHandle):
            handle = BlockHandle.from_bytes(handle)
        handle.check(namespace)
        if len(local_offsets) != len(handle.runs):
            raise ValueError(f"{len(local_offsets)} local offsets for {len(handle.runs)} runs")
        timeout = self.config.timeout if timeout is None else timeout
        # One deadline for the whole pull, passed down rather than enforced
        # by an asyncio.timeout around it (`_peer_arena`).
        deadline = asyncio.get_running_loop().time() + timeout
        peer = None
        try:
            peer, info = await self._peer_arena(handle, deadline)
            # Both sides' bounds, checked before any byte moves.
            # (numpy-free: from a cold cache every numpy call costs tens of us)
            rows, nbytes = plan_rows(handle.runs_buffer, local_offsets, info.size, local.size)
            if peer.same_host and (info.shm or info.pid) and not local.is_cuda:
                plan = self.copy_plan or fast_copy_plan(self.config.fast_copy)
                triples = rows_array(rows)
                await copy_shared(
                    peer, info, local, triples, read, nbytes, plan, deadline, self._inline
                )
            else:
                await self.transport.move(peer, handle, local, rows, read, deadline)
        except TimeoutError:
            if peer is not None:
                self._drop_peer(peer)
            raise TransferTimeout(
                f"{'read' if read else 'write'} of {handle.nbytes} bytes from {handle.agent} "
                f"did not finish within {timeout} s"
            ) from None
        except (PeerError, ProtocolError, AuthError, asyncio.CancelledError):
            # A cancelled tcp read leaves its connection mid-stream: drop it too.
            if peer is not None:
                self._drop_peer(peer)
            raise

    async def _peer_arena(self, handle: BlockHandle, deadline: float) -> tuple[Peer, ArenaInfo]:
        """The handle's peer and arena, rkey and base checked. A known peer and
        arena need no wait and no timer (setting one up and cancelling it costs
        about 100 us from a cold cache; a 64 KiB run moves in 10): only
        connecting or refreshing the arena table waits, until `deadline` (loop
        clock). A peer that fails or times out meanwhile is dropped."""
        peer = self._peers.get(handle.agent)
        info = peer.arenas.get(handle.arena_id) if peer is not None else None
        if info is None or peer.agent_id != handle.agent_id:
            try:
                async with asyncio.timeout_at(deadline):
                    peer = await self._peer(handle)
                    info = await self._arena_info(peer, handle.arena_id)
            except (TimeoutError, PeerError, ProtocolError, AuthError, asyncio.CancelledError):
                if peer is not None:
                    self._drop_peer(peer)
                raise
        handle.check_key(info)
        return peer, info

    async def release_remote(self, handle: BlockHandle, timeout: float | None = None) -> None:
        """Tells the publisher the reader is done with the handle's pages."""
        # The deadline covers connecting too: a peer that accepts and never
        # answers must not hold the caller.
        async with asyncio.timeout(timeout or self.config.timeout):
            peer = await self._peer(handle)
            async with peer.conn.lock:
                await rpc.call(peer.conn, Release(lease=handle.lease_id), rpc.Ok, None)

    # -- peers -----------------------------------------------------------------
    async def _peer(self, handle: BlockHandle) -> Peer:
        peer = self._peers.get(handle.agent)
        if peer is not None and peer.agent_id != handle.agent_id:
            self._drop_peer(peer)  # maybe a new agent at that address: ask again
            peer = None
        if peer is None:
            self._drop_closed_peers()
            peer = await self._connect(handle.agent)
            # Concurrent pulls from one agent may each have connected while
            # the other awaited: keep the first peer, close the extra socket.
            first = self._peers.setdefault(handle.agent, peer)
            if first is not peer:
                peer.conn.close()
                peer = first
        if peer.agent_id != handle.agent_id:
            raise UnknownArena(f"the handle names an earlier instance of agent {handle.agent}")
        return peer

    def _drop_closed_peers(self) -> None:
        # A peer that closed its connection (it exited or restarted) is
        # otherwise dropped only when used again: until then its mappings
        # would keep its arenas' memory alive here.
        for peer in list(self._peers.values()):
            if peer.conn.closed_by_peer():
                self._drop_peer(peer)

    async def _connect(self, address: str) -> Peer:
        conn, hello = await rpc.connect(
            address, self.config.token, AgentWelcome, self.config.timeout
        )
        peer = Peer(address, hello.agent_id, hello.host_id, _arenas(hello.arenas), conn, hello)
        peer.on_host = peer.host_id == self.host_id
        peer.same_host = self.config.fast_path and peer.on_host
        return peer

    async def _arena_info(self, peer: Peer, arena_id: int) -> ArenaInfo:
        if arena_id not in peer.arenas:  # registered after our hello: refresh once
            async with peer.conn.lock:
                table = (await rpc.call(peer.conn, Arenas(), ArenaTable, None)).arenas
            peer.arenas = _arenas(table)
        info = peer.arenas.get(arena_id)
        if info is None:
            raise UnknownArena(f"agent {peer.address} has no arena {arena_id}")
        return info

    def _drop_peer(self, peer: Peer) -> None:
        if self._peers.get(peer.address) is peer:
            del self._peers[peer.address]
        self.transport.drop_peer(peer)
        for mapped in peer.mappings.values():
            mapped.close()
        peer.mappings.clear()
        peer.conn.close()

    def stats(self) -> dict:
        return {
            "arenas": len(self.arenas),
            "leases": len(self.leases),
            "peers": len(self._peers),
            "mappings": sum(len(p.mappings) for p in self._peers.values()),
            **self.transport.stats(),
        }

    # -- control server --------------------------------------------------------
    def _welcome(self) -> AgentWelcome:
        return AgentWelcome(
            self.agent_id, self.host_id, self.arena_table(), **self.transport.hello_fields()
        )

    def _scoped_welcome(self, scope: rpc.Scope) -> AgentWelcome:
        return AgentWelcome(
            self.agent_id, self.host_id, self.arena_table(scope), **self.transport.hello_fields()
        )

    async def _handle(self, conn: rpc.Connection, request) -> rpc.Message | None:
        if isinstance(request, Arenas):
            return ArenaTable(self.arena_table(conn.scope))
        if isinstance(request, Release):
            lease = self.leases.get(request.lease)
            if lease is not None and conn.scope.allows(lease.namespace):
                self.leases.release(request.lease)
            return rpc.Ok()
        return await self.transport.serve(self, conn, request)


def _arenas(table: list[ArenaInfo]) -> dict[int, ArenaInfo]:
    return {info.arena_id: info for info in table}
