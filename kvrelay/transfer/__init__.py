"""Transfer engine (DESIGN.md section 4): move unified pages between agents.

    agent = await create_agent("ucx", token="...")      # or "tcp", "loopback"
    arena = agent.allocate_arena(64 << 20)
    handle = agent.publish(arena, runs, spec.namespace())   # -> send handle.to_bytes()
    await reader.read(handle_bytes, local_arena, offsets, namespace=spec.namespace())

Backends are chosen by name and imported lazily; a missing library raises
`BackendUnavailable` with what to install.
"""

from __future__ import annotations

import importlib

from kvrelay.transfer.agent import Agent
from kvrelay.transfer.arena import Arena
from kvrelay.transfer.base import AgentConfig, Transport
from kvrelay.transfer.errors import (
    AuthError,
    BackendUnavailable,
    HandleError,
    HandleVersionError,
    LeaseExpired,
    MalformedHandle,
    NamespaceMismatch,
    PeerError,
    ProtocolError,
    RkeyMismatch,
    RunOutOfBounds,
    TransferError,
    TransferTimeout,
    UnknownArena,
)
from kvrelay.transfer.handle import HANDLE_VERSION, ArenaInfo, BlockHandle, coalesce

BACKENDS = {
    "ucx": ("kvrelay.transfer.backends.ucx", "UcxTransport"),
    "tcp": ("kvrelay.transfer.backends.tcp", "TcpTransport"),
    "loopback": ("kvrelay.transfer.backends.loopback", "LoopbackTransport"),
}


def make_transport(name: str) -> Transport:
    if name not in BACKENDS:
        raise ValueError(f"unknown transfer backend {name!r}; choose one of {sorted(BACKENDS)}")
    module, cls = BACKENDS[name]
    return getattr(importlib.import_module(module), cls)()


def available(name: str) -> bool:
    """Whether the named backend's library loads here (ucx: `kvrelay._ucx` was built)."""
    try:
        importlib.import_module(BACKENDS[name][0])
    except ImportError:  # BackendUnavailable is one
        return False
    return True


async def create_agent(backend: str = "tcp", **config) -> Agent:
    """A started agent of the named backend (see `AgentConfig` for the settings)."""
    agent = Agent(AgentConfig(backend=backend, **config), make_transport(backend))
    return await agent.start()


__all__ = [
    "BACKENDS",
    "HANDLE_VERSION",
    "Agent",
    "AgentConfig",
    "Arena",
    "ArenaInfo",
    "AuthError",
    "BackendUnavailable",
    "BlockHandle",
    "HandleError",
    "HandleVersionError",
    "LeaseExpired",
    "MalformedHandle",
    "NamespaceMismatch",
    "PeerError",
    "ProtocolError",
    "RkeyMismatch",
    "RunOutOfBounds",
    "TransferError",
    "TransferTimeout",
    "UnknownArena",
    "available",
    "coalesce",
    "create_agent",
    "make_transport",
]
