"""Typed errors of the RPC layer: what talking to another kvrelay process can end in.

`RpcError` is the base of every error of a connection or a call, and of the
transfer engine's errors too (`kvrelay.transfer.errors.TransferError`
derives from it), so a caller that treats "the peer failed" one way catches
one class.
"""

from __future__ import annotations


class RpcError(Exception):
    """Base of every error of a control connection or a call over it."""


class AuthError(RpcError):
    """A hello without the right cluster token (or no hello at all)."""


class ProtocolError(RpcError):
    """A frame that is not msgpack, is larger than the frame limit, or is not
    the message the protocol expects at that point."""


class MalformedMessage(ProtocolError):
    """A well-framed message that does not validate against its declared type
    (missing or mistyped field, unknown op). The connection stays usable."""


class WireVersionError(ProtocolError):
    """The peer speaks another wire version; the message names both."""


class PeerError(RpcError):
    """The peer failed, closed the connection, or refused the request."""


class RpcTimeout(RpcError, TimeoutError):
    """A call or a hello did not finish before its deadline."""


class RemoteError(PeerError):
    """The peer answered with a typed error reply: `error` is the name of its
    exception class, `rid` the request it concerned (if any)."""

    def __init__(self, error: str, message: str, rid: str | None = None) -> None:
        super().__init__(f"{error}: {message}" if message else error)
        self.error = error
        self.remote_message = message
        self.rid = rid
