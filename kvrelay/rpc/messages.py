"""The messages every service shares: the hello, the typed error reply, the
plain acknowledgement, and the field types the service messages reuse.

Every frame is a `msgspec.Struct` tagged by its `op` field, so one decoder
per expected union validates a frame in one place (`Connection.recv`).
Token arrays travel packed (`Tokens`: little-endian uint32), not as lists of
msgpack integers.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
import numpy as np

from kvrelay.rpc.errors import AuthError, RemoteError, WireVersionError

# Version 2: typed frames (`op` on every reply, `error` replies instead of
# `ok: false`), packed token arrays. A peer of another version gets a
# `WireVersionError` reply to its hello and the connection closes.
WIRE_VERSION = 2

U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack carries up to 2**64 - 1
Count = Annotated[int, msgspec.Meta(ge=0)]
Key = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]  # a page key or namespace
Run = tuple[U64, Annotated[int, msgspec.Meta(gt=0)]]  # (offset, length)
# Packed little-endian uint32 token ids (4 bytes each).
Tokens = Annotated[bytes, msgspec.Meta(max_length=4 << 22)]


class Message(msgspec.Struct, tag_field="op", forbid_unknown_fields=True):
    """Base of every frame: tagged by `op`, unknown fields refused."""


class Hello(Message, tag="hello"):
    """The first frame of every connection. Its shape never changes across
    wire versions: it is how versions are told apart."""

    v: int
    token: str


class Error(Message, tag="error"):
    """The one error reply of every service: `error` is the exception class
    name (callers tell `Busy`, `RequestError`, `LeaseExpired` ... apart by it)."""

    error: str
    message: str = ""
    rid: str | None = None
    # Always false: a peer of wire version 1, which reads `ok`, sees a refusal.
    ok: bool = False

    @classmethod
    def of(cls, exc: BaseException, rid: str | None = None) -> Error:
        return cls(type(exc).__name__, str(exc)[:2000], rid)

    def exception(self) -> Exception:
        if self.error == "AuthError":
            return AuthError(self.message)
        if self.error == "WireVersionError":
            return WireVersionError(self.message)
        return RemoteError(self.error, self.message, self.rid)


class Ok(Message, tag="ok"):
    """A plain acknowledgement."""


def pack_tokens(tokens) -> bytes:
    """Token ids as the wire carries them (little-endian uint32)."""
    array = np.asarray(tokens, dtype=np.int64)
    if array.size and (array.min() < 0 or array.max() >= 1 << 32):
        raise ValueError("token ids must be in [0, 2**32)")
    return array.astype("<u4").tobytes()


def unpack_tokens(data: bytes) -> list[int]:
    if len(data) % 4:
        raise ValueError(f"packed tokens are 4-byte records, got {len(data)} bytes")
    return np.frombuffer(data, dtype="<u4").tolist()
