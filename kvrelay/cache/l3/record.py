"""The self-checking record every L3 store keeps a page in.

A 96-byte header, then the page bytes:

    magic "KVR3" | version u8 | 3 zero bytes | namespace (32) | page key (32)
    | length u64 LE | digest (16)

`digest` is BLAKE2b-128 over the namespace, the key and the page bytes, so a
torn write, a flipped bit, a truncated file or a value stored under the wrong
key or tenant all fail to decode, and the caller treats the page as a miss.

Version 2 added the namespace (version 1 records decode as misses and are
dropped; there is no deployed data to migrate). The stores also put the
namespace in the object's name, so flushing one tenant finds its pages
without reading them.
"""

from __future__ import annotations

import hashlib
import struct

KEY_BYTES = 32  # a sha256 page key
NAMESPACE_BYTES = 32  # a sha256 namespace digest
# Pages written without a namespace (b"") are filed under all zeros.
NO_NAMESPACE = bytes(NAMESPACE_BYTES)
MAGIC = b"KVR3"
VERSION = 2
_HEADER = struct.Struct("<4sB3s32s32sQ16s")
_RESERVED = bytes(3)
HEADER_BYTES = _HEADER.size  # 96


def normalize_namespace(namespace: bytes) -> bytes:
    """`namespace` as the 32 bytes stored: b"" (none given) becomes all zeros."""
    if namespace == b"":
        return NO_NAMESPACE
    if not isinstance(namespace, bytes) or len(namespace) != NAMESPACE_BYTES:
        raise ValueError(f"a namespace is {NAMESPACE_BYTES} bytes or b'', got {namespace!r:.80}")
    return namespace


def _digest(namespace: bytes, key: bytes, payload: bytes | memoryview) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(namespace)
    h.update(key)
    h.update(payload)
    return h.digest()


def encode_header(key: bytes, payload: bytes | memoryview, namespace: bytes = b"") -> bytes:
    """The header for `payload`; write it followed by the payload itself."""
    ns = normalize_namespace(namespace)
    return _HEADER.pack(MAGIC, VERSION, _RESERVED, ns, key, len(payload), _digest(ns, key, payload))


def encode(key: bytes, payload: bytes | memoryview, namespace: bytes = b"") -> bytes:
    return encode_header(key, payload, namespace) + bytes(payload)


def decode(key: bytes, record: bytes | memoryview, namespace: bytes = b"") -> memoryview | None:
    """The page bytes of `record` if it is whole, for `key` in `namespace` and unaltered;
    else None."""
    ns = normalize_namespace(namespace)
    if len(record) < HEADER_BYTES:
        return None
    magic, version, reserved, stored_ns, stored_key, length, digest = _HEADER.unpack_from(record)
    if (
        magic != MAGIC
        or version != VERSION
        or reserved != _RESERVED
        or stored_ns != ns
        or stored_key != key
    ):
        return None
    payload = memoryview(record)[HEADER_BYTES:]
    if len(payload) != length or _digest(ns, key, payload) != digest:
        return None
    return payload
