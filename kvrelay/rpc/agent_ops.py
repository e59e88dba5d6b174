"""Messages between transfer agents (control connection of `kvrelay.transfer`).

After the hello the owner answers `AgentWelcome` (its arena table); then a
reader may ask `Arenas` (a table refresh), `Release` (a lease ended early),
and, on the tcp backend, `Read`/`Write` of packed runs, answered `Accepted`
before the bytes follow on the same socket (a write is confirmed `Ok`).
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec

from kvrelay.rpc.messages import U64, Message

# Packed little-endian uint64 (offset, length) pairs, 16 bytes a run.
PackedRuns = Annotated[bytes, msgspec.Meta(max_length=16 << 20)]


class ArenaInfo(msgspec.Struct, array_like=True, frozen=True):
    """An arena as its owner publishes it to authenticated peers."""

    arena_id: U64
    base: U64
    size: U64
    rkey: bytes = b""
    shm: str = ""  # same-host fast path: memfd path readers may map ("" = none)
    # Same-host fast path for host memory that is not a memfd (a caller's
    # registered tensor): the owner's pid, for process_vm_readv (0 = none).
    pid: U64 = 0


class AgentWelcome(Message, tag="agent"):
    agent_id: bytes
    host_id: str
    arenas: list[ArenaInfo]
    ucx_address: bytes | None = None  # the ucx backend's worker address


class Arenas(Message, tag="arenas"):
    pass


class ArenaTable(Message, tag="arena_table"):
    arenas: list[ArenaInfo]


class Release(Message, tag="release"):
    lease: int


class Read(Message, tag="read"):
    arena: int
    lease: int
    runs: PackedRuns


class Write(Message, tag="write"):
    arena: int
    lease: int
    runs: PackedRuns


class Accepted(Message, tag="accepted"):
    nbytes: int


AgentRequest = Union[Arenas, Release, Read, Write]  # noqa: UP007 (msgspec takes a Union)
