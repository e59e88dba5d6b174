"""Control-plane RPC (DESIGN.md section 4): framing, the hello with the
cluster token, the one accept loop, typed messages (msgspec), typed error
replies, deadlines. Imports only the standard library, msgspec and numpy:
control uses it without the data plane (no torch)."""

from kvrelay.rpc.channel import Channel, Unavailable
from kvrelay.rpc.client import answer, call, connect, hello
from kvrelay.rpc.errors import (
    AuthError,
    MalformedMessage,
    PeerError,
    ProtocolError,
    RemoteError,
    RpcError,
    RpcTimeout,
    WireVersionError,
)
from kvrelay.rpc.framing import MAX_FRAME, Connection, listen_socket, split_address
from kvrelay.rpc.messages import (
    WIRE_VERSION,
    Error,
    Hello,
    Message,
    Ok,
    pack_tokens,
    unpack_tokens,
)
from kvrelay.rpc.scope import EVERY_NAMESPACE, Scope, scoped_token, token_scope
from kvrelay.rpc.server import Server

__all__ = [
    "EVERY_NAMESPACE",
    "MAX_FRAME",
    "WIRE_VERSION",
    "AuthError",
    "Channel",
    "Connection",
    "Error",
    "Hello",
    "MalformedMessage",
    "Message",
    "Ok",
    "PeerError",
    "ProtocolError",
    "RemoteError",
    "RpcError",
    "RpcTimeout",
    "Scope",
    "Server",
    "Unavailable",
    "WireVersionError",
    "answer",
    "call",
    "connect",
    "hello",
    "listen_socket",
    "pack_tokens",
    "scoped_token",
    "split_address",
    "token_scope",
    "unpack_tokens",
]
