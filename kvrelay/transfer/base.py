"""The interface between the agent and its data-plane backends."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvrelay.rpc import Connection, Message, ProtocolError
from kvrelay.rpc.agent_ops import AgentWelcome, ArenaInfo
from kvrelay.rpc.cache_ops import DEFAULT_LEASE_S
from kvrelay.transfer.arena import Arena, RemoteMapping
from kvrelay.transfer.handle import BlockHandle

if TYPE_CHECKING:
    from kvrelay.transfer.calibrate import CopyPlan


@dataclass(slots=True)
class AgentConfig:
    """How an agent runs. `token` is the cluster token every control connection presents."""

    token: str
    backend: str = "tcp"
    host: str = "127.0.0.1"
    port: int = 0
    fast_path: bool = True  # same-host peers copy straight out of shared arenas
    # How the fast path copies: "calibrated" (what this host measured fastest,
    # see calibrate.py), or forced: "map" (plain stores out of the mapped
    # memfd, one thread) or "readv" (process_vm_readv, one thread).
    fast_copy: str = "calibrated"
    # What a pull of STRIPE_MIN_BYTES or more is split over (stripes.py):
    # two UCX workers (same-host peers) or two TCP connections. 0 as this
    # host measured (ucx: two where two kernel copies beat one by
    # STRIPE_MARGIN in the calibration; tcp: two where the process may
    # run on two CPUs), or 1 (never) or 2.
    stripes: int = 0
    timeout: float = 10.0  # default deadline of a read or write, seconds
    lease_seconds: float = DEFAULT_LEASE_S


@dataclass(eq=False, slots=True)
class Peer:
    """What this agent knows about another agent it reads from or writes to."""

    address: str
    agent_id: bytes
    host_id: str
    arenas: dict[int, ArenaInfo]
    conn: Connection
    hello: AgentWelcome
    on_host: bool = False  # the peer runs on this host (and PID namespace)
    same_host: bool = False  # on_host and the fast path is enabled
    state: object = None  # the backend's per-peer objects (ucx: endpoint, rkeys)
    mappings: dict[int, RemoteMapping] = field(default_factory=dict)


class Transport(ABC):
    """Moves bytes between a local arena and a peer's arena; one per agent."""

    name: str
    # Whether `register` takes device (CUDA) memory; the others move host memory only.
    device_memory: bool = False
    # Whether every byte a peer moves goes through `serve`, checked against a
    # lease: only such a backend admits tenant-scoped peers (rkeys reach a
    # whole arena).
    lease_bounded: bool = False

    def hello_fields(self) -> dict:
        """Fields of `AgentWelcome` this backend fills in (e.g. a UCX worker address)."""
        return {}

    def register(self, arena: Arena) -> bytes:
        """Registers an arena; returns its packed rkey (b"" when the backend has none)."""
        return b""

    def deregister(self, arena: Arena) -> None:  # noqa: B027 (optional hook)
        pass

    def tune(self, config: AgentConfig, plan: CopyPlan | None) -> None:  # noqa: B027
        """Takes the agent's settings and this host's measured copy plan
        (None when the agent measured none), before the agent serves."""

    def wants_copy_plan(self, config: AgentConfig) -> bool:
        """Whether `tune` needs the host's calibration even without the fast path."""
        return False

    @abstractmethod
    async def move(
        self,
        peer: Peer,
        handle: BlockHandle,
        local: Arena,
        rows: bytes | bytearray | np.ndarray,
        read: bool,
        deadline: float,
    ) -> None:
        """Moves `rows`, a buffer of native uint64 (remote offset, local
        offset, length) triples, already validated and coalesced
        (`handle.plan_rows`; `handle.rows_array` views them as a (k, 3)
        array). Raises TimeoutError once the event loop's
        clock passes `deadline` (the agent turns it into TransferTimeout); on
        that or on cancellation nothing may still touch `local` when this
        returns."""

    async def serve(self, agent, conn: Connection, request: Message) -> Message | None:
        """Serves a backend-specific control request (tcp: `Read`, `Write`)."""
        raise ProtocolError(f"the {self.name} backend serves no {type(request).__name__}")

    def drop_peer(self, peer: Peer) -> None:  # noqa: B027 (optional hook)
        """Releases what this backend holds for a failed or closed peer."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        pass

    def stats(self) -> dict:
        return {}
