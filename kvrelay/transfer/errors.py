"""Typed errors of the transfer engine.

Everything a peer or a handle can get wrong is a `TransferError` subclass, so
callers can tell a hostile or stale handle (`HandleError`, raised before any
byte moves) from a peer that failed (`PeerError`) or a deadline (`TransferTimeout`).
"""

from __future__ import annotations

# The control connection's errors are the RPC layer's (one class each).
from kvrelay.rpc.errors import AuthError, PeerError, ProtocolError, RpcError

__all__ = ["AuthError", "PeerError", "ProtocolError"]  # re-exported; the rest are defined here


class TransferError(RpcError):
    """Base of every transfer-engine error (an `RpcError`: a peer failed us)."""


class BackendUnavailable(TransferError, ImportError):
    """A backend's library is missing; the message says what to install or set."""


class HandleError(TransferError, ValueError):
    """A block handle that must not be used; raised before any byte moves."""


class MalformedHandle(HandleError):
    """Not a handle: truncated or invalid msgpack, missing or mistyped fields."""


class HandleVersionError(HandleError):
    """A handle of a wire version this agent does not speak."""


class NamespaceMismatch(HandleError):
    """The handle's pages belong to another model/layout namespace."""


class LeaseExpired(HandleError):
    """The handle's lease has expired (or was released): the pages may be reused."""


class UnknownArena(HandleError):
    """The peer has no arena of that id."""


class RkeyMismatch(HandleError):
    """The handle's packed rkey or base address is not the one the peer published."""


class RunOutOfBounds(HandleError, IndexError):
    """A byte run outside its arena (remote or local), or a bad run length."""


class TransferTimeout(TransferError, TimeoutError):
    """A transfer or a control call did not finish before its deadline."""
