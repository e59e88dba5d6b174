"""Messages between cache clients (workers, control's tier probe) and a cache server.

- `Lookup {keys, lease_s, ns, runs?}` -> `LookupReply {hits, lease, handle?}`:
  the length of the sealed prefix, pinned under `lease` (None when nothing
  hit); with `runs`, also the block handle of those runs of every hit page
  (what `PublishHandle` would answer, without its round trip)
- `Reserve {keys, lease_s, ns, runs?}` -> `ReserveReply {slots, lease,
  handle?}`: a slot per key to write, None for a page already sealed or no
  room; with `runs`, the handle of those runs of every slot given, in order
- `PublishHandle {lease, count, runs, ns}` -> `HandleReply {handle}`: a block
  handle for the first `count` pages of a lookup or reservation lease,
  `runs` (the caller's rectangle within one page) of each
- `Commit {keys, runs, ns, release?}` -> `CommitReply {sealed}` per key;
  `release` names the reservation lease to release once committed
- `ReleaseLease {lease}` -> `ReleaseReply {released}`
- `Touch {keys, ns}` -> `TouchReply {hits}`: pages a client read off the
  server's slot board (`CacheWelcome.board`), counted as a lookup's use
- `CacheStats` -> `CacheStatsReply`; `Flush {ns?}` -> `FlushReply {dropped,
  l3_dropped}`: the unpinned L2 pages and the L3 pages of one namespace, or all
- `GetRing` -> `RingReply {version, servers}`: the ring of cache servers
  control published last, as the server heard it (clients follow it)
- `Announce {ns, identity}` -> `AnnounceReply {kept, near}`: the identity
  fields a client's namespace hashes from; `near` lists the server's other
  namespaces of the same model, the fields each differs in and its pages
- `ListNamespaces` -> `NamespacesReply {namespaces}`: every namespace the
  server holds pages of or heard of, with its fields and page count
"""

from __future__ import annotations

from typing import Annotated, Any, Union

import msgspec

from kvrelay.rpc.messages import Count, Key, Message, Run

# The longest a client may pin pages (lookups, reservations). One bound for
# every lease in the system (kvrelay.rpc.worker_ops uses it too): a lease
# only has to outlive one transfer, and a longer one lets a client that
# died keep pages pinned, or staging rows held, that long.
MAX_LEASE_S = 300.0
DEFAULT_LEASE_S = 30.0
LeaseSeconds = Annotated[float, msgspec.Meta(gt=0, le=MAX_LEASE_S)]
Keys = Annotated[list[Key], msgspec.Meta(max_length=1 << 20)]
Runs = Annotated[list[Run], msgspec.Meta(min_length=1)]


class CacheWelcome(Message, tag="cache"):
    page_bytes: int
    agent: str  # the server's transfer agent
    # Where a same-host client maps the slot board (kvrelay.cache.slot_board)
    # and its size; None where the server keeps none.
    board: str | None = None
    board_bytes: int = 0


class Lookup(Message, tag="lookup"):
    keys: Keys
    lease_s: LeaseSeconds = DEFAULT_LEASE_S
    ns: Key | None = None
    runs: Runs | None = None  # publish a handle of these runs of each hit (needs ns)


class LookupReply(Message, tag="lookup_reply"):
    hits: Count
    lease: int | None = None
    # The server may hold more of the chain than it could answer at once (its
    # L2 had no room to bring more up from L3): ask again from `hits` after
    # taking and releasing these.
    more: bool = False
    handle: bytes | None = None  # with `runs`, when something hit


class Reserve(Message, tag="reserve"):
    keys: Keys
    lease_s: LeaseSeconds = DEFAULT_LEASE_S
    ns: Key | None = None
    runs: Runs | None = None  # publish a handle of these runs of each slot (needs ns)


class ReserveReply(Message, tag="reserve_reply"):
    slots: list[int | None]
    lease: int
    # Some pages were refused for want of room while the server has an L3
    # to make room into: reserve them again after committing and releasing.
    more: bool = False
    handle: bytes | None = None  # with `runs`, when a slot was given


class PublishHandle(Message, tag="handle"):
    lease: int
    count: Annotated[int, msgspec.Meta(ge=1)]
    runs: Runs
    ns: Key


class HandleReply(Message, tag="handle_reply"):
    handle: bytes


class Commit(Message, tag="commit"):
    keys: Keys
    runs: Runs
    ns: Key | None = None
    release: int | None = None  # the reservation's lease, released after the commit


class CommitReply(Message, tag="commit_reply"):
    sealed: list[bool]


class ReleaseLease(Message, tag="release"):
    lease: int


class ReleaseReply(Message, tag="release_reply"):
    released: bool


class Touch(Message, tag="touch"):
    keys: Keys
    ns: Key | None = None


class TouchReply(Message, tag="touch_reply"):
    hits: Count


class CacheStats(Message, tag="stats"):
    pass


class CacheStatsReply(Message, tag="stats_reply"):
    tier: dict[str, int]
    pages: int
    l3: dict[str, int] | None = None


class GetRing(Message, tag="get_ring"):
    pass


class RingReply(Message, tag="ring_reply"):
    """The ring control published last (version 0, no servers: none, a static list)."""

    version: Annotated[int, msgspec.Meta(ge=0)]
    servers: list[str]


class Flush(Message, tag="flush"):
    ns: Key | None = None


class FlushReply(Message, tag="flush_reply"):
    dropped: int
    l3_dropped: int = 0


Identity = Annotated[dict[str, Any], msgspec.Meta(max_length=64)]


class Announce(Message, tag="announce"):
    ns: Key
    identity: Identity


class NamespaceInfo(msgspec.Struct, frozen=True):
    ns: bytes
    identity: dict[str, Any] | None
    pages: int
    differs: list[str] = []


class AnnounceReply(Message, tag="announce_reply"):
    kept: bool  # the fields hash to the namespace
    near: list[NamespaceInfo]


class ListNamespaces(Message, tag="list_namespaces"):
    pass


class NamespacesReply(Message, tag="namespaces_reply"):
    namespaces: list[NamespaceInfo]


CacheRequest = Union[  # noqa: UP007 (msgspec takes a Union)
    Lookup, Reserve, PublishHandle, Commit, ReleaseLease, Touch, CacheStats, Flush, GetRing,
    Announce, ListNamespaces,
]  # fmt: skip
