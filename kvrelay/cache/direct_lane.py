"""A cache client's reads and writes of same-host servers, made on the caller's thread.

An engine calls its cache backend from threads of its own; the client lives
on the backend's event loop, and a call that hops there and back pays two
thread wake-ups beside the server's (0.1-0.3 ms each on a small VM, where
an idle vCPU halts). Where every server of a call is a same-host agent
whose arena the transfer agent has already mapped (`Agent.copy_mapped`
met it), a `DirectLane` makes the call on the caller's thread instead:
the same requests over blocking sockets of its own (`SyncChannel`), the
page copied by a `SlotCopier` straight between the engine's memory and the
server's slots in the agent's mapping of its arena (under the mapping's
lock), the same checks as a transfer (namespace, lease, rkey, every run in
bounds).

A lane answers None where it cannot make the call (a server not met yet or
on another host, one down, a chain longer than the server can pin at once,
write-back): the caller makes it on the loop, which does all of those.
Nothing a lane did then counts: a read is redone whole, a write's pages
already sealed are skipped by the server. Leases it took are released
(posted) on every path.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from kvrelay.cache.policy import WritePolicy
from kvrelay.layout import ring_prefix
from kvrelay.rpc import Unavailable
from kvrelay.rpc.cache_ops import (
    CacheWelcome,
    Commit,
    CommitReply,
    Lookup,
    LookupReply,
    ReleaseLease,
    ReleaseReply,
    Reserve,
    ReserveReply,
)
from kvrelay.rpc.sync_channel import SyncChannel
from kvrelay.transfer import BlockHandle, TransferError

if TYPE_CHECKING:
    from kvrelay.cache.client import CacheClient

# After a server failed on the lane, its calls go by the loop this long.
OFF_LANE_S = 5.0


class SlotCopier(Protocol):
    def copy_slots(
        self,
        arena: torch.Tensor,
        client: CacheClient,
        handle: BlockHandle,
        positions: Sequence[int],
        *,
        to_slots: bool,
    ) -> bool:
        """Copy the call's pages `positions` into (or out of) the handle's
        slots in `arena`, a server's whole arena mapped here; False where
        these pages cannot go straight there."""
        ...


class _OffLane(Exception):
    """This call cannot be made on the lane."""


class DirectLane:
    """One client's calls on the caller's thread (one thread at a time)."""

    def __init__(self, client: CacheClient) -> None:
        self.client = client
        self._channels: dict[str, SyncChannel] = {}
        self._off_until: dict[str, float] = {}  # server -> monotonic time
        self._lock = threading.Lock()
        self.calls = 0  # calls made here, to the end

    def read(self, keys: Sequence[bytes], copier: SlotCopier) -> int | None:
        """Copy the longest cached prefix of `keys` out of the servers' slots;
        its length, or None where the loop must make the call."""
        with self._lock:
            return self._call(keys, copier, self._read)

    def write(self, keys: Sequence[bytes], copier: SlotCopier) -> int | None:
        """Write-through of `keys` into the servers' slots; pages written, or None."""
        c = self.client
        if c.config.write_policy is not WritePolicy.WRITE_THROUGH:
            return None
        if not c.rect.writer or not keys:
            return 0
        with self._lock:
            return self._call(keys, copier, self._write)

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()

    # -- one call ------------------------------------------------------------------
    def _call(self, keys, copier, make) -> int | None:
        ring = self.client.ring
        groups = ring.group(keys)
        if not all(self._on_lane(server) for server in groups):
            return None
        leases: list[tuple[str, int]] = []
        try:
            done = make(ring, keys, groups, copier, leases)
        except (_OffLane, TransferError, Unavailable):
            return None
        finally:
            for server, lease in leases:
                self._channels[server].post(ReleaseLease(lease), ReleaseReply)
        self.calls += 1
        return done

    def _read(self, ring, keys, groups, copier, leases) -> int:
        c = self.client
        answers = {}
        for server, positions in groups.items():
            lookup = Lookup([keys[p] for p in positions], c.config.lease_s, c.namespace, c.runs)
            reply = self._request(server, lookup, LookupReply)
            if reply.lease is not None:
                leases.append((server, reply.lease))
            answers[server] = reply
        prefix, taken = ring_prefix(ring, keys, {s: a.hits for s, a in answers.items()})
        if prefix < len(keys) and answers[ring.server_for(keys[prefix])].more:
            raise _OffLane  # the server holds more than it pins at once: the loop reads in turns
        for server, positions in groups.items():
            if taken[server]:
                count = taken[server]
                self._copy(answers[server].handle, count, positions[:count], copier, False)
        c.stats.lookups += 1
        c.stats.lookup_pages += len(keys)
        c.stats.hit_pages += prefix
        c.stats.bytes_in += prefix * c.rect.num_bytes(c.spec)
        return prefix

    def _write(self, ring, keys, groups, copier, leases) -> int:
        c = self.client
        written = 0
        for server, positions in groups.items():
            mine = [keys[p] for p in positions]
            reply = self._request(
                server, Reserve(mine, c.config.lease_s, c.namespace, c.runs), ReserveReply
            )
            leases.append((server, reply.lease))
            todo = [p for p, slot in zip(positions, reply.slots, strict=True) if slot is not None]
            if todo:
                self._copy(reply.handle, len(todo), todo, copier, True)
                commit = Commit([keys[p] for p in todo], c._commit_runs, c.namespace, reply.lease)
                self._request(server, commit, CommitReply)
                leases.pop()  # released by the commit
                written += len(todo)
            if todo and reply.more and len(todo) < len(positions):
                raise _OffLane  # room for the rest is made in turns: the loop writes them
        c.stats.written_pages += written
        c.stats.bytes_out += written * c.rect.num_bytes(c.spec)
        return written

    # -- servers and their arenas ----------------------------------------------------------
    def _on_lane(self, server: str) -> bool:
        """Whether `server`'s calls can be made here: it answers, and the agent
        has mapped its transfer agent's arena (a same-host peer)."""
        if self._off_until.get(server, 0.0) > time.monotonic():
            return False
        channel = self._channels.get(server)
        if channel is None:
            c = self.client
            channel = SyncChannel(server, c.config.token, CacheWelcome, c.config.timeout_s,
                                  c._check_welcome)  # fmt: skip
            self._channels[server] = channel
        try:
            welcome = channel.welcome_reply or channel.connect()
        except Unavailable:
            self._off_until[server] = time.monotonic() + OFF_LANE_S
            return False
        return bool(self.client.agent.peer_is_mapped(welcome.agent))

    def _request(self, server: str, request, reply):
        try:
            return self._channels[server].call(request, reply)
        except Unavailable:
            self._off_until[server] = time.monotonic() + OFF_LANE_S
            raise

    def _copy(self, raw, count: int, positions, copier: SlotCopier, to_slots: bool) -> None:
        c = self.client
        if raw is None:
            raise _OffLane  # a server that does not publish handles with its answers
        handle = c.pages_handle(raw, count)
        mapped = c.agent.known_mapping(handle, c.namespace)
        if mapped is None:
            raise _OffLane
        with mapped.lock:
            if not mapped.size:  # closed: the agent dropped the peer
                raise _OffLane
            if not copier.copy_slots(mapped.tensor(), c, handle, positions, to_slots=to_slots):
                raise _OffLane
