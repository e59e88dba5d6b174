"""Traces of `kvrelay bench cache`: Mooncake-format requests and the page keys
and contents the replay gives their blocks."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

NAMESPACE = hashlib.sha256(b"kvrelay bench cache").digest()


def load_trace(path: str | Path, limit: int | None = None) -> list[dict]:
    requests = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                requests.append(json.loads(line))
                if limit is not None and len(requests) >= limit:
                    break
    return requests


class KeyChain:
    """Page keys of hash-id sequences: sha256 over the parent key and the block's tokens."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._keys: dict[tuple[bytes, int], bytes] = {}

    def tokens(self, hash_id: int) -> bytes:
        # Deterministic per hash id, distinct between ids: uint32 LE as in layout.
        base = hash_id * self.block_tokens
        return struct.pack(f"<{self.block_tokens}I", *range(base, base + self.block_tokens))

    def keys(self, hash_ids: list[int]) -> list[bytes]:
        parent = NAMESPACE
        out = []
        for hash_id in hash_ids:
            memo = (parent, hash_id)
            key = self._keys.get(memo)
            if key is None:
                key = hashlib.sha256(parent + self.tokens(hash_id)).digest()
                self._keys[memo] = key
            out.append(key)
            parent = key
        return out


def page_content(key: bytes, size: int) -> bytes:
    """A page's deterministic bytes in the replay: its key, repeated."""
    return (key * (size // len(key) + 1))[:size]
