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

A read whose every page is on its servers' slot boards (`slot_board`, a
server's shared-memory map of which slot holds which sealed page) asks no
server at all: the lane finds the slots there, copies, checks that no slot
changed meanwhile, and reports the read (`Touch`, with its next request to
that server or within about a second) so that it counts as a use.
The board is used once an answered call has shown that the server's arena
is mapped here and the namespace is the client's.

A large write's commit is posted, not waited for (its server seals the
pages while the caller goes on: 0.4-0.7 ms a call here); a read of the client's
lanes that does not find every page on the boards, and a read of its loop
where the caller asks (`LaneShare.settle`), first takes the answers of the
commits posted to its servers, so a client reads what it wrote.

A lane answers None where it cannot make the call (a server not met yet or
on another host, one down, a chain longer than the server can pin at once,
write-back): the caller makes it on the loop, which does all of those.
Nothing a lane did then counts: a read is redone whole, a write's pages
already sealed are skipped by the server. Leases it took are released
(posted) on every path.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from kvrelay.cache.policy import WritePolicy
from kvrelay.cache.slot_board import BOARD_SAFE, BoardError, BoardReader
from kvrelay.cache.tenants import tenant_keys
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
    Touch,
    TouchReply,
)
from kvrelay.rpc.sync_channel import SyncChannel
from kvrelay.transfer import BlockHandle, TransferError
from kvrelay.transfer.arena import RemoteMapping

if TYPE_CHECKING:
    from kvrelay.cache.client import CacheClient

# After a server failed on the lane, its calls go by the loop this long.
OFF_LANE_S = 5.0
# Reads off a board are reported (`Touch`) with the lane's next request to
# their server, or once this old: a post of their own wakes the idle server,
# whose work then lands on the reader's time (0.25 ms a read on a small VM).
TOUCH_DELAY_S = 0.5
TOUCH_MAX_KEYS = 4096
# A write of this many bytes to a server or more posts its commit; a smaller
# one waits for the answer. Posting saves the writer the round trip (0.4-0.7
# ms here) but hands it to the client's next read of those pages if that read
# comes first; measured here, with SGLang's 64-page calls read back at once,
# it saved a 64 MiB write 0.7-1.2 ms at no cost to the read, and a 4 MiB
# write no more than it cost the read.
POST_COMMIT_BYTES = 16 << 20


class SlotCopier(Protocol):
    def copy_slots(
        self,
        arena: torch.Tensor,
        client: CacheClient,
        slots: np.ndarray,
        positions: Sequence[int],
        *,
        to_slots: bool,
    ) -> bool:
        """Copy the call's pages `positions` into (or out of) `slots` (int64,
        one per position; slot i is bytes [i, i + 1) x page_bytes) of `arena`,
        a server's whole arena mapped here, the client's `runs` of each;
        False where these pages cannot go straight there."""
        ...


def handle_slots(handle: BlockHandle, client: CacheClient) -> np.ndarray:
    """The slot of each page a server's handle names for `client` (int64):
    its first run of each page, less that run's place in a slot."""
    first = handle.run_array[:: len(client.runs), 0].astype(np.int64) - client.runs[0][0]
    slots, rest = np.divmod(first, client.slot_bytes)
    if rest.any() or (first < 0).any():
        raise TransferError("a cache server's runs are not at its slots' places")
    return slots


@dataclass(eq=False, slots=True)
class _Board:
    welcome: CacheWelcome  # the server's welcome it came with (another: not that server)
    reader: BoardReader | None  # None: the server keeps none this lane can use
    mapped: RemoteMapping  # the server's arena, as the agent mapped it


@dataclass(eq=False)
class LaneShare:
    """What the lanes of one client share: the servers' slot boards (one
    lane's answered call maps a server's board for all: a write lane's for
    the reads) and the channels with commits posted and not yet answered."""

    boards: dict[str, _Board] = field(default_factory=dict)
    unsettled: dict[str, set[SyncChannel]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def posted(self, server: str, channel: SyncChannel) -> None:
        with self.lock:
            self.unsettled.setdefault(server, set()).add(channel)

    def settle(self, servers=None) -> bool:
        """Take the answers of the commits posted to `servers` (all: None):
        once answered, a server has sealed their pages. Whether any was posted."""
        with self.lock:
            chosen = list(self.unsettled) if servers is None else servers
            channels = {ch for s in chosen for ch in self.unsettled.pop(s, ())}
        for channel in channels:
            channel.settle()  # a failure closes the socket: the server has what it read
        return bool(channels)


class _OffLane(Exception):
    """This call cannot be made on the lane."""


class DirectLane:
    """One client's calls on the caller's thread (one thread at a time)."""

    def __init__(self, client: CacheClient, share: LaneShare | None = None) -> None:
        """`share`: the same for every lane of one client."""
        self.client = client
        self.share = LaneShare() if share is None else share
        self._channels: dict[str, SyncChannel] = {}
        self._off_until: dict[str, float] = {}  # server -> monotonic time
        self._boards = self.share.boards
        # server -> (monotonic time of the oldest, keys read off its board, unreported)
        self._touches: dict[str, tuple[float, list[bytes]]] = {}
        self._lock = threading.Lock()
        self.calls = 0  # calls made here, to the end
        self.board_reads = 0  # of which reads that asked no server
        self._closed = threading.Event()
        # Here, not at the first read: a start waits for the thread (0.5 ms on a small VM).
        self._reporter = threading.Thread(target=self._report_late, daemon=True,
                                          name="kvrelay-board-touches")  # fmt: skip
        self._reporter.start()

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
        self._closed.set()
        self._reporter.join(timeout=self.client.config.timeout_s)
        self.share.settle(list(self._channels))
        with self._lock:
            self._report(list(self._touches))
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
            self._boards.clear()  # maps unmapped when the last lane lets go

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
        # Every page on the boards is sealed, whatever commits are unanswered;
        # a miss may be this client's own write whose commit is on its way.
        if self._board_read(keys, groups, copier) or (
            self.share.settle(list(groups)) and self._board_read(keys, groups, copier)
        ):
            return len(keys)
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
                self._copy(server, answers[server].handle, count, positions[:count], copier,
                           False)  # fmt: skip
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
                self._copy(server, reply.handle, len(todo), todo, copier, True)
                commit = Commit([keys[p] for p in todo], c._commit_runs, c.namespace, reply.lease)
                if len(todo) * c.rect.num_bytes(c.spec) < POST_COMMIT_BYTES:
                    self._request(server, commit, CommitReply)
                elif self._channels[server].post(commit, CommitReply):
                    self.share.posted(server, self._channels[server])
                else:
                    raise _OffLane  # not sent: the loop writes the pages again
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
        self._report([server])  # the server is woken anyway: its board reads go first
        try:
            return self._channels[server].call(request, reply)
        except Unavailable:
            self._off_until[server] = time.monotonic() + OFF_LANE_S
            raise

    def _copy(self, server, raw, count: int, positions, copier, to_slots: bool) -> None:
        c = self.client
        if raw is None:
            raise _OffLane  # a server that does not publish handles with its answers
        handle = c.pages_handle(raw, count)
        mapped = c.agent.known_mapping(handle, c.namespace)
        if mapped is None:
            raise _OffLane
        self._slot_copy(mapped, handle_slots(handle, c), positions, copier, to_slots)
        self._keep_board(server, mapped)

    def _slot_copy(self, mapped: RemoteMapping, slots, positions, copier, to_slots) -> None:
        c = self.client
        with mapped.lock:
            if not mapped.size:  # closed: the agent dropped the peer
                raise _OffLane
            if not copier.copy_slots(mapped.tensor(), c, slots, positions, to_slots=to_slots):
                raise _OffLane

    # -- the slot boards ---------------------------------------------------------------
    def _keep_board(self, server: str, mapped: RemoteMapping) -> None:
        """After an answered call: the server's board, mapped here once."""
        welcome = self._channels[server].welcome_reply
        board = self._boards.get(server)
        if board is not None and board.welcome == welcome and board.mapped is mapped:
            return
        reader = None
        with contextlib.suppress(OSError, BoardError):  # not mappable: every read asks
            usable = welcome.board and BOARD_SAFE  # a reader must order its loads too
            reader = BoardReader(welcome.board, welcome.board_bytes) if usable else None
        if reader is not None and reader.num_slots * self.client.slot_bytes > mapped.size:
            reader.close()
            reader = None
        self._boards[server] = _Board(welcome, reader, mapped)

    def _report(self, servers) -> None:
        """Post the board reads not yet reported to `servers` (best effort: a
        server gone takes them with it, as a lost lookup's hits)."""
        for server in servers:
            if server in self._touches:
                _, keys = self._touches.pop(server)
                self._channels[server].post(Touch(keys, self.client.namespace), TouchReply)

    def _report_late(self) -> None:
        """The reporter thread's: reads of an engine gone quiet are reported
        within about two TOUCH_DELAY_S too; and a server whose board another
        lane of the client mapped is connected here ahead of this lane's
        first call to it (a connection is a round trip and a hello)."""
        while not self._closed.wait(TOUCH_DELAY_S):
            unmet = [s for s in list(self._boards) if s not in self._channels]
            if not (self._touches or unmet) or not self._lock.acquire(timeout=TOUCH_DELAY_S):
                continue
            try:
                late = time.monotonic() - TOUCH_DELAY_S
                self._report([s for s, (since, _) in self._touches.items() if since <= late])
                for server in unmet:
                    self._on_lane(server)
            finally:
                self._lock.release()

    def _board_read(self, keys, groups, copier) -> bool:
        """Every page of `keys` copied off the servers' boards, or False
        (then nothing this did counts: the call asks the servers)."""
        c, found = self.client, []
        for server, positions in groups.items():
            board = self._boards.get(server)
            if (board is None or board.reader is None
                    or board.welcome != self._channels[server].welcome_reply):  # fmt: skip
                return False
            mine = [keys[p] for p in positions]
            hit = board.reader.find(tenant_keys(c.namespace, mine))
            if hit is None:
                return False
            found.append((server, mine, positions, board, hit))
        for _, _, positions, board, (slots, gens) in found:
            self._slot_copy(board.mapped, slots, positions, copier, False)
            if not board.reader.unchanged(slots, gens):
                return False  # a slot was given to another page meanwhile
        now = time.monotonic()
        for server, mine, _, _, _ in found:
            since, pending = self._touches.setdefault(server, (now, []))
            pending.extend(mine)
            if now - since >= TOUCH_DELAY_S or len(pending) >= TOUCH_MAX_KEYS:
                self._report([server])
        self.board_reads += 1
        c.stats.lookups += 1
        c.stats.lookup_pages += len(keys)
        c.stats.hit_pages += len(keys)
        c.stats.bytes_in += len(keys) * c.rect.num_bytes(c.spec)
        return True
