"""Block handles: what a reader needs to pull pages from a peer, as msgpack.

A handle names the publishing agent (its control address and instance id),
an arena of it (id, base address, packed rkey), byte runs of pages inside that
arena (offsets from the arena start), a lease (id and wall-clock expiry) and
the namespace digest of the pages. Readers decode and validate it against the
arena table the peer itself published over an authenticated control
connection, so a forged handle cannot name bytes outside a registered arena.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Annotated

import msgspec
import numpy as np

from kvrelay.rpc.agent_ops import ArenaInfo
from kvrelay.transfer.errors import (
    HandleVersionError,
    LeaseExpired,
    MalformedHandle,
    NamespaceMismatch,
    RkeyMismatch,
    RunOutOfBounds,
)

# Version 2 carries the runs as one little-endian uint64 byte string
# (offset, length, offset, length, ...) instead of a list of pairs: a batch
# handle has hundreds of runs, and decoding them one msgpack item at a time
# cost more than moving a 64 KiB run.
HANDLE_VERSION = 2
MAX_HANDLE_BYTES = 16 << 20
MAX_RUNS = 1 << 20
_U64 = (1 << 64) - 1
# Native uint64 where the host is little-endian, so decoded runs need no copy.
_LE_U64 = np.dtype(np.uint64) if sys.byteorder == "little" else np.dtype("<u8")
U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack integers end at 2**64 - 1


class HandleWire(msgspec.Struct, forbid_unknown_fields=True):
    """A handle as it travels: a msgpack map, these keys in this order (the
    same bytes as the hand-written encoding of version 2 had). Decoding
    validates every field's type and range in one place."""

    v: int
    backend: str
    agent: str
    agent_id: bytes
    arena: U64
    rkey: bytes
    base: U64
    # One byte string of little-endian uint64 (offset, length) pairs.
    runs: Annotated[bytes, msgspec.Meta(max_length=16 * MAX_RUNS)]
    lease: U64
    expiry: float
    ns: bytes


class _Version(msgspec.Struct):
    """Only a handle's version (the other fields may be of another version)."""

    v: int


_DECODE_WIRE = msgspec.msgpack.Decoder(HandleWire)
_DECODE_VERSION = msgspec.msgpack.Decoder(_Version)


class Runs(Sequence):
    """A decoded handle's runs, kept as the wire's bytes (little-endian uint64
    offset, length pairs): the uint64 array and the (offset, length) tuples
    are made on first use. A reader that only pulls hands the bytes to the
    compiled planner and needs neither: from a cold cache (every pull after
    a large one) numpy's frombuffer and reshape cost about 70 us, and
    building 512 tuples was a third of the cost of decoding a batch handle."""

    __slots__ = ("_array", "_raw", "_tuples")

    def __init__(self, raw: bytes) -> None:
        self._raw = raw
        self._array: np.ndarray | None = None
        self._tuples: tuple[tuple[int, int], ...] | None = None

    @property
    def raw(self) -> bytes:
        """The runs as the wire carries them (what `plan_rows` takes)."""
        return self._raw

    def array(self) -> np.ndarray:
        """The runs as an (n, 2) uint64 array (a read-only view of the bytes)."""
        if self._array is None:
            self._array = np.frombuffer(self._raw, dtype=_LE_U64).reshape(-1, 2)
        return self._array

    def tuples(self) -> tuple[tuple[int, int], ...]:
        if self._tuples is None:
            a = self.array()
            self._tuples = tuple(zip(a[:, 0].tolist(), a[:, 1].tolist(), strict=True))
        return self._tuples

    def __len__(self) -> int:
        return len(self._raw) // 16

    def __getitem__(self, index):
        return self.tuples()[index]

    def __iter__(self):
        return iter(self.tuples())

    def __eq__(self, other) -> bool:
        if isinstance(other, Runs):
            other = other.tuples()
        return self.tuples() == other if isinstance(other, tuple) else NotImplemented

    def __hash__(self) -> int:
        return hash(self.tuples())

    def __repr__(self) -> str:
        return repr(self.tuples())


@dataclass(frozen=True, slots=True)
class BlockHandle:
    backend: str
    agent: str
    agent_id: bytes
    arena_id: int
    rkey: bytes
    base: int
    runs: tuple[tuple[int, int], ...] | Runs
    lease_id: int
    lease_expiry: float
    namespace: bytes
    version: int = HANDLE_VERSION
    # The runs as an (n, 2) uint64 array, built once (decode or first use).
    # Not an init field, so `dataclasses.replace` never carries a stale one.
    _array: np.ndarray | None = field(default=None, init=False, compare=False, repr=False)

    @property
    def run_array(self) -> np.ndarray:
        if self._array is None:
            object.__setattr__(self, "_array", run_array(self.runs))
        return self._array

    @property
    def runs_buffer(self):
        """The runs as a buffer of uint64 (offset, length) pairs, for
        `plan_rows`: a decoded handle's wire bytes as they are."""
        if isinstance(self.runs, Runs) and sys.byteorder == "little":
            return self.runs.raw
        return np.ascontiguousarray(self.run_array, dtype=np.uint64)  # native order

    @property
    def nbytes(self) -> int:
        return int(self.run_array[:, 1].sum()) if self.runs else 0

    def narrow(self, runs) -> BlockHandle:
        """The same handle for a subset of its bytes: each of `runs` (arena
        offsets, like `self.runs`) must lie inside one of the handle's runs.
        A reader pulls only what it needs (e.g. its own rectangle of a
        writer's pages). RunOutOfBounds for anything outside."""
        wanted = check_runs(runs, _U64, "narrowed") if len(runs) else run_array(runs)
        if not len(wanted):
            raise RunOutOfBounds("a narrowed handle needs at least one run")
        have = self.run_array
        order = np.argsort(have[:, 0], kind="stable")
        starts = have[order, 0]
        # Runs may overlap: the furthest end among runs starting at or before
        # a wanted run's start says whether one of them contains it.
        ends = np.maximum.accumulate(have[order, 0] + have[order, 1])
        at = np.searchsorted(starts, wanted[:, 0], side="right").astype(np.int64) - 1
        ok = at >= 0
        ok[ok] &= wanted[ok, 0] + wanted[ok, 1] <= ends[at[ok]]
        if not ok.all():
            i = int(np.argmin(ok))
            raise RunOutOfBounds(
                f"narrowed run {i} ({int(wanted[i, 0])}, {int(wanted[i, 1])}) is not inside "
                "one run of the handle"
            )
        return replace(self, runs=tuple(map(tuple, wanted.tolist())))

    def to_bytes(self) -> bytes:
        return msgspec.msgpack.encode(
            HandleWire(
                v=self.version,
                backend=self.backend,
                agent=self.agent,
                agent_id=self.agent_id,
                arena=self.arena_id,
                rkey=self.rkey,
                base=self.base,
                runs=self.run_array.astype("<u8", copy=False).tobytes(),
                lease=self.lease_id,
                expiry=float(self.lease_expiry),
                ns=self.namespace,
            )
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> BlockHandle:
        """Decodes a handle; anything but a well-formed one is a
        `MalformedHandle`, one of another version a `HandleVersionError`."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise MalformedHandle(f"a handle is bytes, got {type(data).__name__}")
        if len(data) > MAX_HANDLE_BYTES:
            raise MalformedHandle(f"handle of {len(data)} bytes exceeds {MAX_HANDLE_BYTES}")
        try:
            wire = _DECODE_WIRE.decode(data)
        except msgspec.DecodeError as exc:
            _check_version(data)
            raise MalformedHandle(f"not a handle: {exc}") from exc
        if wire.v != HANDLE_VERSION:
            raise HandleVersionError(f"handle version {wire.v}, this agent speaks {HANDLE_VERSION}")
        if len(wire.runs) % 16:
            raise MalformedHandle("handle field 'runs' is not 16-byte (offset, length) records")
        # Every 64-bit pattern is a valid uint64: bounds are checked against
        # the arena when a pull is planned.
        handle = cls(wire.backend, wire.agent, wire.agent_id, wire.arena, wire.rkey, wire.base,
                     Runs(wire.runs), wire.lease, wire.expiry, wire.ns)  # fmt: skip
        return handle

    def check(self, namespace: bytes, now: float | None = None) -> None:
        """Checks what needs no peer: namespace and lease."""
        if self.namespace != namespace:
            raise NamespaceMismatch(
                f"handle namespace {self.namespace.hex()[:16]}... is not the expected "
                f"{namespace.hex()[:16]}..."
            )
        if self.lease_expiry <= (time.time() if now is None else now):
            raise LeaseExpired(f"lease {self.lease_id} expired at {self.lease_expiry:.3f}")

    def check_key(self, arena: ArenaInfo) -> None:
        """Checks the handle's rkey and base against the arena its owner published
        (its runs are checked by `plan_checked`)."""
        if self.rkey != arena.rkey or self.base != arena.base:
            raise RkeyMismatch(f"handle's rkey/base do not match arena {arena.arena_id}")


def run_array(runs) -> np.ndarray:
    """[offset, length] pairs as an (n, 2) uint64 array; non-integers or negatives refused."""
    if isinstance(runs, Runs):
        return runs.array()
    if isinstance(runs, np.ndarray) and runs.dtype == np.uint64:
        return runs.reshape(-1, 2)
    try:
        return np.array(runs, dtype=np.uint64).reshape(-1, 2)
    except (OverflowError, ValueError, TypeError):
        raise RunOutOfBounds("runs must be [offset, length] pairs of unsigned integers") from None


def check_runs(runs, size: int, side: str) -> np.ndarray:
    """Raises RunOutOfBounds unless every run is non-empty and inside [0, size)."""
    arr = run_array(runs)
    offset, length = arr[:, 0], arr[:, 1]
    size = np.uint64(size)
    # `size - offset` wraps when offset > size, which the first test catches.
    bad = (length == 0) | (offset > size) | (length > size - offset)
    if bad.any():
        i = int(np.argmax(bad))
        raise RunOutOfBounds(
            f"{side} run {i} ({int(offset[i])}, {int(length[i])}) is outside [0, {int(size)}) "
            "or empty"
        )
    return arr


def plan(remote_runs, local_offsets) -> np.ndarray:
    """(k, 3) uint64 rows (remote offset, local offset, length), coalesced: rows that
    continue each other on both sides become one operation."""
    remote = run_array(remote_runs)
    if len(local_offsets) != len(remote):
        raise ValueError(f"{len(local_offsets)} local offsets for {len(remote)} runs")
    rows = np.empty((len(remote), 3), dtype=np.uint64)
    if len(remote) == 0:
        return rows
    rows[:, 0] = remote[:, 0]
    rows[:, 1] = local_offsets  # raises on negatives, non-integers and a wrong count
    rows[:, 2] = remote[:, 1]
    r, local, n = rows[:, 0], rows[:, 1], rows[:, 2]
    joins = (r[1:] == r[:-1] + n[:-1]) & (local[1:] == local[:-1] + n[:-1])
    if not joins.any():  # scattered runs (the usual batch): nothing to merge
        return rows
    first = np.flatnonzero(np.concatenate(([True], ~joins)))
    return np.stack([r[first], local[first], np.add.reduceat(n, first)], axis=1)


def plan_runs_reference(remote_runs, local_offsets, remote_size: int, local_size: int):
    """The reference of the compiled `_runcopy.plan_runs` (same signature and
    results): checks the remote runs (a uint64 buffer of (offset, length)
    pairs) against [0, remote_size), merges runs that continue each other on
    both sides, checks the merged local ranges against [0, local_size), and
    returns (bytearray of uint64 (remote, local, length) rows, byte count)."""
    raw = memoryview(remote_runs).cast("B")
    if len(raw) % 16:
        raise ValueError("remote runs must be uint64 (offset, length) pairs")
    remote = np.frombuffer(raw, dtype=np.uint64).reshape(-1, 2)
    if isinstance(local_offsets, np.ndarray) and local_offsets.dtype == np.uint64:
        local = local_offsets.reshape(-1).tolist()
    else:
        local = [_offset(x) for x in local_offsets]
    if len(local) != len(remote):
        raise ValueError(f"{len(local)} local offsets for {len(remote)} runs")
    check_runs(remote, remote_size, "remote")
    rows = plan(remote, np.array(local, dtype=np.uint64))
    check_runs(rows[:, 1:], local_size, "local")
    rows = np.ascontiguousarray(rows, dtype=np.uint64)
    return bytearray(rows.tobytes()), int(rows[:, 2].sum())


def _offset(value) -> int:
    if not isinstance(value, int):
        raise TypeError("local offsets must be ints")
    if not 0 <= value <= _U64:
        raise OverflowError(f"local offset {value} is not an unsigned 64-bit integer")
    return value


def _compiled_plan_runs():
    try:
        from kvrelay.transfer import _runcopy
    except ImportError:  # built without it: same results, slower
        return plan_runs_reference
    _runcopy.set_bounds_error(RunOutOfBounds)
    return _runcopy.plan_runs


_plan_runs = _compiled_plan_runs()


def plan_rows(remote_runs, local_offsets, remote_size: int, local_size: int):
    """`plan_checked` without numpy: the rows as a bytearray of uint64
    (remote offset, local offset, length) triples, and their byte count.
    `remote_runs` is a buffer of uint64 (offset, length) pairs (a decoded
    handle's `runs_buffer`). What a pull hands its transport."""
    return _plan_runs(remote_runs, local_offsets, remote_size, local_size)


def rows_array(rows) -> np.ndarray:
    """`plan_rows`' rows as a (k, 3) uint64 array (a view, no copy)."""
    if isinstance(rows, np.ndarray):
        return rows.reshape(-1, 3)
    return np.frombuffer(rows, dtype=np.uint64).reshape(-1, 3)


def plan_checked(remote_runs, local_offsets, remote_size: int, local_size: int):
    """(k, 3) uint64 rows (remote offset, local offset, length), coalesced, with
    every remote run inside [0, remote_size) and every local range inside [0,
    local_size) (RunOutOfBounds otherwise), and their byte count."""
    runs = run_array(remote_runs)
    if not runs.flags.c_contiguous:
        runs = np.ascontiguousarray(runs)
    rows, nbytes = plan_rows(runs, local_offsets, remote_size, local_size)
    return rows_array(rows), nbytes


def coalesce(pairs: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Merges (remote, local, length) triples that continue each other on both sides."""
    if not pairs:
        return []
    arr = np.asarray(pairs, dtype=np.uint64).reshape(-1, 3)
    return [tuple(row) for row in plan(arr[:, [0, 2]], arr[:, 1]).tolist()]


def _check_version(data) -> None:
    """HandleVersionError when `data` is a map with an integer version other
    than ours (its other fields may follow another version's layout)."""
    try:
        version = _DECODE_VERSION.decode(data).v
    except msgspec.DecodeError:
        return
    if version != HANDLE_VERSION:
        raise HandleVersionError(f"handle version {version}, this agent speaks {HANDLE_VERSION}")
