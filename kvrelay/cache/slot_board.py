"""The slot board: which arena slot holds which sealed page, in shared memory.

A same-host client that has the server's arena mapped can read a page
without asking the server where it is: the server keeps, in a memfd that
such clients map read-only, the key each slot holds and a generation per
slot, and a hash table from key to slot. A read then costs no round trip
(on a small VM the lookup's two wake-ups are most of a small read).

Nothing is pinned; the generation makes the read safe instead (a seqlock).
A slot's generation is even while the slot holds a sealed page that no one
may write, odd otherwise. The server makes it odd before the slot can be
given to anything else (eviction, flush, removal), writes a new key only
while it is odd, and makes it even once that page is sealed. A reader takes
a slot's generation, then compares its key, copies the page out, and takes
the generation again: the same even value both times means the bytes it
copied were that key's sealed page from start to end. Anything else (a
miss, a changed generation, a full bucket) sends the read to the server.

The table is `buckets` x `WAYS` entries (slot + 1, 0 empty) over the key's
first eight bytes (keys are BLAKE2b digests). A page whose bucket is full
is not on the board; it is still read through the server.

Layout (little-endian, offsets in bytes): a 64-byte header (magic, version,
slots, buckets, ways, key bytes), then `gens` (u64 per slot), `keys`
(KEY_BYTES per slot), `table` (i64 per entry).
"""

from __future__ import annotations

import mmap
import os
import platform

import numpy as np

from kvrelay.cache.index import KEY_BYTES

MAGIC = int.from_bytes(b"KVRBOARD", "little")
VERSION = 1
WAYS = 8
_HEADER = 64

try:
    from kvrelay.transfer._runcopy import board_find, fence
except ImportError:  # no compiled module: only x86's total store order is safe without it
    board_find = fence = None
# Where the board cannot order its loads and stores, no reader uses it.
BOARD_SAFE = fence is not None or platform.machine() in ("x86_64", "AMD64")
if fence is None:

    def fence() -> None:
        pass


class BoardError(ValueError):
    """A board that is not what its header or its mapping says."""


def _buckets(num_slots: int) -> int:
    """A power of two with room for every slot about four times over."""
    want = max(1, (4 * num_slots) // WAYS)
    return 1 << (want - 1).bit_length()


def _sizes(num_slots: int, buckets: int) -> tuple[int, int, int, int]:
    gens = _HEADER
    keys = gens + 8 * num_slots
    table = keys + KEY_BYTES * num_slots
    table += -table % 8
    return gens, keys, table, table + 8 * buckets * WAYS


def _views(buf, num_slots: int, buckets: int):
    gens_at, keys_at, table_at, _ = _sizes(num_slots, buckets)
    gens = np.frombuffer(buf, np.uint64, num_slots, gens_at)
    keys = np.frombuffer(buf, np.uint8, KEY_BYTES * num_slots, keys_at).reshape(num_slots, -1)
    table = np.frombuffer(buf, np.int64, buckets * WAYS, table_at).reshape(buckets, WAYS)
    return gens, keys, table


def find_reference(table, gens, keys64, digests: bytes, out: np.ndarray) -> bool:
    """The reference of the compiled `_runcopy.board_find` (the same result
    from the same board): for each 32-byte digest, the first way of its
    bucket naming a slot whose generation is even and key the digest; its
    (slot, generation) into `out` ((n, 2) uint64). True when all were found."""
    want = np.frombuffer(digests, "<u8").reshape(-1, KEY_BYTES // 8)
    named = table[(want[:, 0] & np.uint64(len(table) - 1)).astype(np.intp)]  # (n, WAYS)
    inside = (named > 0) & (named <= len(gens))
    slots = np.where(inside, named - 1, 0)
    seen = gens[slots]
    fence()  # generations before keys
    match = inside & ((seen & np.uint64(1)) == 0) & (keys64[slots] == want[:, None, :]).all(axis=2)
    way = match.argmax(axis=1)
    rows = np.arange(len(want))
    out[:, 0], out[:, 1] = slots[rows, way], seen[rows, way]
    return bool(match[rows, way].all())


def _bucket(key: bytes, mask: int) -> int:
    return int.from_bytes(key[:8], "little") & mask


class SlotBoard:
    """The server's side: it writes the board (on the tier's thread only)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.buckets = _buckets(num_slots)
        size = _sizes(num_slots, self.buckets)[3]
        self._fd = os.memfd_create("kvrelay-slot-board", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, size)
        self._map = mmap.mmap(self._fd, size)
        header = np.frombuffer(self._map, np.uint64, 6)
        header[:] = [MAGIC, VERSION, num_slots, self.buckets, WAYS, KEY_BYTES]
        self.gens, self.keys, self.table = _views(self._map, num_slots, self.buckets)
        self.gens[:] = 1  # odd: nothing readable yet
        # Element by element through memoryviews: a page's publish or withdraw
        # is a few scalar stores, which numpy makes ten times dearer (every
        # commit and eviction of the server pays them).
        self._gens = memoryview(self.gens).cast("B").cast("Q")
        self._table = memoryview(self.table).cast("B").cast("q")
        self._keys = memoryview(self.keys).cast("B")
        self.size = size
        self.path = f"/proc/{os.getpid()}/fd/{self._fd}"
        self.full = 0  # pages left off for a full bucket

    def publish(self, key: bytes, slot: int) -> bool:
        """`key`'s sealed page is in `slot`; False where its bucket is full."""
        if not self._gens[slot] & 1:
            return False  # readable already
        first = _bucket(key, self.buckets - 1) * WAYS
        row = self._table[first : first + WAYS].tolist()
        if 0 not in row:
            self.full += 1
            return False
        self._keys[slot * KEY_BYTES : (slot + 1) * KEY_BYTES] = key
        fence()  # the key before the generation that makes it readable
        self._gens[slot] += 1
        self._table[first + row.index(0)] = slot + 1
        return True

    def withdraw(self, key: bytes, slot: int) -> None:
        """`slot` no longer holds `key` sealed: readers of it from now on fail."""
        if self._gens[slot] & 1:
            return  # never published (a reservation, a full bucket) or withdrawn
        self._gens[slot] += 1
        fence()  # odd before the slot can be handed to a writer
        first = _bucket(key, self.buckets - 1) * WAYS
        row = self._table[first : first + WAYS].tolist()
        if slot + 1 in row:
            self._table[first + row.index(slot + 1)] = 0

    def close(self) -> None:
        for view in (self._gens, self._table, self._keys):
            view.release()
        self.gens = self.keys = self.table = None
        self._map.close()
        os.close(self._fd)


class BoardReader:
    """A client's read-only mapping of a server's board."""

    def __init__(self, path: str, size: int) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size < size:
                raise BoardError(f"{path} is smaller than the board the server announced")
            # Populated: a read's first look at a part of the board faults no page in.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._map = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        header = np.frombuffer(self._map, np.uint64, 6)
        magic, version, num_slots, buckets, ways, key_bytes = (int(v) for v in header)
        if (magic, version, ways, key_bytes) != (MAGIC, VERSION, WAYS, KEY_BYTES):
            raise BoardError(f"{path} is not a slot board of version {VERSION}")
        if buckets & (buckets - 1) or _sizes(num_slots, buckets)[3] != size:
            raise BoardError(f"{path}: the header does not match its size")
        self.num_slots, self.buckets = num_slots, buckets
        self.gens, self.keys, self.table = _views(self._map, num_slots, buckets)
        self._keys64 = self.keys.view("<u8")  # (slots, 4): a key compared in 4 words
        arrays = (self.table, self.gens, self.keys)
        self._board = (*(a.ctypes.data for a in arrays), num_slots, buckets)

    def find(self, keys: list[bytes]) -> tuple[np.ndarray, np.ndarray] | None:
        """The slot and generation of every key, or None where one is not on
        the board. Generations are taken before the keys are compared (see
        the module's docstring); `unchanged` checks them after the copy."""
        out = np.empty((len(keys), 2), np.uint64)
        digests = b"".join(keys)
        if board_find is not None:  # the compiled walk: a few cache lines a key
            found = board_find(*self._board, digests, out)
        else:
            found = find_reference(self.table, self.gens, self._keys64, digests, out)
        if not found:
            return None
        return out[:, 0].astype(np.int64), out[:, 1]

    def unchanged(self, slots: np.ndarray, gens: np.ndarray) -> bool:
        """Whether no slot's generation moved since `find` (after the copy)."""
        fence()  # the copy's loads before these
        return bool((self.gens[slots] == gens).all())

    def close(self) -> None:
        self.gens = self.keys = self.table = self._keys64 = None
        self._map.close()
