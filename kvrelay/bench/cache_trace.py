"""Traces of `kvrelay bench cache`: Mooncake-format requests and the page keys
and contents the replay gives their blocks."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

NAMESPACE = hashlib.sha256(b"kvrelay bench cache").digest()


def load_trace(path: str | Path, limit: int | None = None) -> list[dict]:
    """The trace's requests (the first `limit`); ValueError naming the line if
    one is not a JSON object, or if there is none (OSError if unreadable)."""
    requests = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                request = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"line {number}: not JSON ({e.msg})") from None
            if not isinstance(request, dict):
                raise ValueError(f"line {number}: not a JSON object")
            requests.append(request)
            if limit is not None and len(requests) >= limit:
                break
    if not requests:
        raise ValueError("no requests")
    return requests


def full_block_ids(request: dict, block_tokens: int) -> list[int]:
    """The request's hash ids that stand for full blocks: the pages a worker caches.

    Mooncake traces give one id per block of the prompt, the last one partial
    when `input_length` is not a multiple of the block; kvrelay keys full
    pages only (a partial page is recomputed, never cached), so a partial
    block is no page of the replay. ValueError if the ids cannot be the
    prompt's blocks of `block_tokens` tokens (fewer than its full blocks, or
    more than its blocks): a trace cut in other blocks than `--block-tokens`.
    """
    try:
        ids, tokens = request["hash_ids"], request["input_length"]
    except KeyError as e:
        raise ValueError(f"no {e.args[0]!r} field") from None
    full, blocks = tokens // block_tokens, -(-tokens // block_tokens)
    if not full <= len(ids) <= blocks:
        raise ValueError(
            f"{len(ids)} hash ids for {tokens} input tokens: not blocks of {block_tokens} tokens"
            f" ({full} full, {blocks} in all)"
        )
    return ids[:full]


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
