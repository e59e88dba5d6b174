"""Byte-level tokenizer: one token per UTF-8 byte, ids 0-255.

Models with a real vocabulary still work through token-id prompts; text
prompts need a vocabulary of at least 256 so every byte is a valid id.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable

BYTE_VOCAB = 256


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(tokens: Iterable[int]) -> str:
    """Text of the byte tokens; ids >= 256 carry no text."""
    return bytes(t for t in tokens if 0 <= t < BYTE_VOCAB).decode("utf-8", errors="replace")


class StreamDecoder:
    """Decodes token batches as they stream, so a character split over two
    batches comes out whole instead of as two replacement characters."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, tokens: Iterable[int]) -> str:
        return self._decoder.decode(bytes(t for t in tokens if 0 <= t < BYTE_VOCAB))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)
