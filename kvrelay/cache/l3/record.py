"""The self-checking record every L3 store keeps a page in.

A 64-byte header, then the page bytes:

    magic "KVR3" | version u8 | 3 zero bytes | page key (32) | length u64 LE | digest (16)

`digest` is BLAKE2b-128 over the key and the page bytes, so a torn write, a
flipped bit, a truncated file or a value stored under the wrong key all fail
to decode, and the caller treats the page as a miss.
"""

from __future__ import annotations

import hashlib
import struct

KEY_BYTES = 32  # a sha256 page key
MAGIC = b"KVR3"
VERSION = 1
_HEADER = struct.Struct("<4sB3s32sQ16s")
_RESERVED = bytes(3)
HEADER_BYTES = _HEADER.size  # 64


def _digest(key: bytes, payload: bytes | memoryview) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(key)
    h.update(payload)
    return h.digest()


def encode_header(key: bytes, payload: bytes | memoryview) -> bytes:
    """The header for `payload`; write it followed by the payload itself."""
    return _HEADER.pack(MAGIC, VERSION, _RESERVED, key, len(payload), _digest(key, payload))


def encode(key: bytes, payload: bytes | memoryview) -> bytes:
    return encode_header(key, payload) + bytes(payload)


def decode(key: bytes, record: bytes | memoryview) -> memoryview | None:
    """The page bytes of `record` if it is whole, for `key` and unaltered; else None."""
    if len(record) < HEADER_BYTES:
        return None
    magic, version, reserved, stored_key, length, digest = _HEADER.unpack_from(record)
    if magic != MAGIC or version != VERSION or reserved != _RESERVED or stored_key != key:
        return None
    payload = memoryview(record)[HEADER_BYTES:]
    if len(payload) != length or _digest(key, payload) != digest:
        return None
    return payload
