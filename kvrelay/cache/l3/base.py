"""The one interface of L3 page stores."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

from kvrelay.cache.l3.record import KEY_BYTES


def check_key(key: bytes) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"a page key is {KEY_BYTES} bytes, got {key!r:.80}")


@dataclass(slots=True)
class L3Stats:
    gets: int = 0
    hits: int = 0
    puts: int = 0
    bytes_in: int = 0  # page bytes stored
    bytes_out: int = 0  # page bytes returned
    evictions: int = 0
    checksum_failures: int = 0
    errors: int = 0  # store unreachable, slow or failing: answered as a miss


class L3Store(abc.ABC):
    """Pages by key, each checked on the way out.

    Never raises for a store-side failure: `get` answers None (a miss) for an
    absent, corrupt or unreachable page, `put` answers False when the page
    was not stored. Invalid arguments still raise.

    Every page is filed under its namespace digest (b"": none given, filed
    under all zeros) as well as its key: a get in another namespace is a miss,
    and `flush(namespace)` finds a tenant's pages without an index.
    """

    name: str

    def __init__(self) -> None:
        self.stats = L3Stats()

    @abc.abstractmethod
    def put(self, key: bytes, page: bytes | memoryview, namespace: bytes = b"") -> bool:
        """Store `page` under `key`, replacing any older copy; True if stored."""

    @abc.abstractmethod
    def get(self, key: bytes, namespace: bytes = b"") -> bytes | None:
        """The page stored under `key`, or None."""

    @abc.abstractmethod
    def delete(self, key: bytes, namespace: bytes = b"") -> bool:
        """Drop `key`; True if it was there."""

    @abc.abstractmethod
    def flush(self, namespace: bytes | None = None) -> int:
        """Drop every page of `namespace` (None: every kvrelay page); return how many."""

    def get_many(self, keys: Sequence[bytes], namespace: bytes = b"") -> list[bytes | None]:
        return [self.get(key, namespace) for key in keys]

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release connections or handles."""

    def __enter__(self) -> L3Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
