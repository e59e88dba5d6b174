"""Consistent hashing of page keys over cache servers (DESIGN.md section 5, scale-out).

Every client builds the same ring from the same server names, so a page's
server follows from its key alone: no central directory. Each server owns
`vnodes` points on a 64-bit circle; a key belongs to the first point at or
after its hash. Adding a server takes over only the arcs before its own
points; removing one hands only its arcs to the next points.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Awaitable, Callable, Iterable, Sequence

DEFAULT_VNODES = 160


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    """Servers (names such as "host:port") placed on a ring by virtual nodes."""

    def __init__(self, servers: Iterable[str] = (), vnodes: int = DEFAULT_VNODES) -> None:
        if vnodes <= 0:
            raise ValueError(f"vnodes must be positive, got {vnodes}")
        self.vnodes = vnodes
        self._servers: set[str] = set()
        self._points: list[int] = []
        self._owners: list[str] = []
        for server in servers:
            self.add(server)

    @property
    def servers(self) -> list[str]:
        return sorted(self._servers)

    def __len__(self) -> int:
        return len(self._servers)

    def __contains__(self, server: str) -> bool:
        return server in self._servers

    def add(self, server: str) -> None:
        if not server:
            raise ValueError("a server name must not be empty")
        if server in self._servers:
            raise ValueError(f"server {server!r} is already on the ring")
        self._servers.add(server)
        for replica in range(self.vnodes):
            point = _point(f"{server}#{replica}".encode())
            at = bisect.bisect_left(self._points, point)
            # Equal points (a 2**-64 chance) are ordered by name so every
            # client breaks the tie the same way, whatever order it added in.
            while (
                at < len(self._points) and self._points[at] == point and self._owners[at] < server
            ):
                at += 1
            self._points.insert(at, point)
            self._owners.insert(at, server)

    def remove(self, server: str) -> None:
        if server not in self._servers:
            raise ValueError(f"server {server!r} is not on the ring")
        self._servers.discard(server)
        kept = [(p, o) for p, o in zip(self._points, self._owners, strict=True) if o != server]
        self._points = [p for p, _ in kept]
        self._owners = [o for _, o in kept]

    def server_for(self, key: bytes) -> str:
        """The server that holds page `key`."""
        if not self._points:
            raise LookupError("the ring has no servers")
        at = bisect.bisect_left(self._points, _point(key))
        return self._owners[at % len(self._owners)]

    def group(self, keys: Sequence[bytes]) -> dict[str, list[int]]:
        """Positions of `keys` per server, in key order, for one request per server."""
        if len(self._servers) == 1:  # no key to hash: a single server holds every page
            return {next(iter(self._servers)): list(range(len(keys)))} if keys else {}
        groups: dict[str, list[int]] = {}
        for position, key in enumerate(keys):
            groups.setdefault(self.server_for(key), []).append(position)
        return groups


def ring_prefix(
    ring: HashRing, keys: Sequence[bytes], hits: dict[str, int]
) -> tuple[int, dict[str, int]]:
    """The tier's prefix of `keys` when server s holds the first `hits[s]` of
    its share: it ends at the first key its server missed. Returns its length
    and how many of each server's keys it takes."""
    if len(ring) == 1 and len(hits) == 1:
        ((server, hit),) = hits.items()
        prefix = min(hit, len(keys))
        return prefix, {server: prefix}
    taken = dict.fromkeys(hits, 0)
    prefix = 0
    for key in keys:
        server = ring.server_for(key)
        if taken[server] >= hits[server]:
            break
        taken[server] += 1
        prefix += 1
    return prefix, taken


async def prefix_in_turns(count: int, turn: Callable[[int], Awaitable[tuple[int, bool]]]) -> int:
    """Length of the tier's prefix of `count` keys, asked for in turns.

    A cache server pins what it answers while it is read, so one whose L2
    cannot hold its share of a long chain at once answers what fits and
    says it may hold more. `turn(start)` looks up the keys from `start`
    (and reads what it found) and answers (pages found, or -1 when a read
    failed; whether the server that ended them may hold more); the next
    turn starts at the first page not taken. -1 when a turn failed."""
    prefix = 0
    while prefix < count:
        got, more = await turn(prefix)
        if got < 0:
            return -1
        prefix += got
        if not (got and more):
            break
    return prefix
