"""Pages pulled by `batch_exists`, kept for the `batch_get_v1` that follows.

SGLang's prefetch asks `batch_exists` for a request's pages, then (on
another thread, once it has host memory for them) `batch_get_v1` for the
pages found. Pulling the rectangles during the lookup, into rows of an arena
of this backend's own, makes the exists call the only one that talks to the
cache servers: the get copies rows into the host pool on SGLang's thread,
with no server call and no hop to the backend's event loop.
Keys name content (the model namespace and the tokens), so a row held for a
key is that key's page for as long as it is held. Rows are reused in
allocation order (a ring): each lookup takes a block of consecutive rows and
forgets whatever those rows held.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class ReadAhead:
    def __init__(self, arena, rect_bytes: int, rows: int) -> None:
        self.arena, self.rect_bytes, self.capacity = arena, rect_bytes, rows
        self.rows = arena.tensor.view(rows, rect_bytes)
        self._row_of: dict[bytes, int] = {}
        self._key_at: list[bytes | None] = [None] * rows
        self._next = 0

    def block(self, count: int) -> int:
        """First row of `count` consecutive rows for a new lookup (<= capacity);
        whatever they held is forgotten."""
        if not 0 < count <= self.capacity:
            raise ValueError(f"a read-ahead block of {count} rows in {self.capacity}")
        start = self._next if self._next + count <= self.capacity else 0
        for row in range(start, start + count):
            key = self._key_at[row]
            if key is not None and self._row_of.get(key) == row:
                del self._row_of[key]
            self._key_at[row] = None
        self._next = start + count
        return start

    def bases(self, start: int, count: int) -> list[int]:
        return [(start + i) * self.rect_bytes for i in range(count)]

    def hold(self, keys: Sequence[bytes], start: int) -> None:
        """Rows start.. now hold `keys`' rectangles."""
        for i, key in enumerate(keys):
            self._row_of[key] = start + i
            self._key_at[start + i] = key

    def prefix(self, keys: Sequence[bytes]) -> torch.Tensor:
        """Rows of the longest prefix of `keys` held, as a [n, rect_bytes] tensor
        (a view when the rows are consecutive, else a copy)."""
        rows = []
        for key in keys:
            row = self._row_of.get(key)
            if row is None:
                break
            rows.append(row)
        if not rows:
            return self.rows[:0]
        if rows == list(range(rows[0], rows[0] + len(rows))):
            return self.rows[rows[0] : rows[0] + len(rows)]
        return self.rows[torch.tensor(rows)]

    def forget(self) -> None:
        self._row_of.clear()
        self._key_at = [None] * self.capacity

    def __len__(self) -> int:
        return len(self._row_of)
