"""Control as a client of the workers: one request's connection to a worker, and
the worker errors control tells apart."""

from __future__ import annotations

import asyncio

from kvrelay import rpc
from kvrelay.control.registry import Node
from kvrelay.rpc.worker_ops import WorkerWelcome

CONNECT_TIMEOUT_S = 5.0


class WorkerError(Exception):
    """Base of what a worker call can end in."""


class WorkerRefused(WorkerError):
    """No connection at all: the worker is gone (removed from the registry)."""


class WorkerFault(WorkerError):
    """Dropped connection, garbage, or an error the worker did not blame on the
    request: the node becomes suspect, the attempt is retried elsewhere."""


class WorkerBusy(WorkerError):
    """The worker's queue is full (or it drains): try the next best worker."""


class WorkerRejected(WorkerError):
    """`RequestError` (bad input), `PoolExhausted` or `StagingTooSmall` (never
    fits this worker)."""

    def __init__(self, error: str, message: str) -> None:
        super().__init__(message)
        self.error = error


class HandlesGone(WorkerError):
    """`PullFailed`: decode could not pull the pages prefill published (that
    prefill died, or their lease ended): no decode can, and this one is not
    at fault. The request goes back to prefill."""


def _refusal(error: rpc.Error, node: Node) -> WorkerError:
    if error.error == "Busy":
        return WorkerBusy(f"{node.node_id} is busy")
    if error.error == "PullFailed":
        return HandlesGone(f"{node.node_id} answered PullFailed: {error.message[:500]}")
    if error.error in ("RequestError", "PoolExhausted", "StagingTooSmall"):
        return WorkerRejected(error.error, error.message[:500] or error.error)
    return WorkerFault(f"{node.node_id} answered {error.error}: {error.message[:500]}")


class WorkerCall:
    """Open, hello, then frames; `close()` is how control cancels the request."""

    def __init__(self, node: Node, token: str, connect_timeout_s: float = CONNECT_TIMEOUT_S):
        self.node = node
        self.token = token
        self.connect_timeout_s = connect_timeout_s
        self.conn: rpc.Connection | None = None

    async def open(self) -> None:
        """Connect and exchange hellos; a host that does not answer within
        `connect_timeout_s` is a fault, so it cannot eat the whole request budget."""
        node = self.node
        host, port = rpc.split_address(node.address)
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                try:
                    self.conn = await rpc.Connection.open(host, port)
                except rpc.PeerError as exc:
                    raise WorkerRefused(f"{node.node_id} at {node.address}: {exc}") from exc
            welcome = await rpc.hello(self.conn, self.token, WorkerWelcome, self.connect_timeout_s)
        except (TimeoutError, rpc.RpcError) as exc:
            raise WorkerFault(f"{node.node_id} refused or missed the hello: {exc}") from exc
        if welcome.role != node.role:
            raise WorkerFault(f"{node.node_id} answers as {welcome.role!r}")

    async def send(self, message: rpc.Message) -> None:
        try:
            await self.conn.send(message)
        except (rpc.RpcError, OSError) as exc:
            raise WorkerFault(f"{self.node.node_id}: {exc}") from exc

    async def recv(self, kind, timeout_s: float | None = None):
        """The next frame as `kind`; an error reply raises its `WorkerError`;
        with `timeout_s`, a worker that takes longer is at fault."""
        try:
            async with asyncio.timeout(timeout_s):
                frame = await self.conn.recv(kind | rpc.Error)
        except (rpc.RpcError, OSError) as exc:
            raise WorkerFault(f"{self.node.node_id}: {exc}") from exc
        except TimeoutError:
            # Only this timeout's own expiry lands here: an outer deadline
            # reaches us as a cancellation and passes through.
            raise WorkerFault(
                f"{self.node.node_id} did not answer within {timeout_s:g} s"
            ) from None
        if isinstance(frame, rpc.Error):
            raise _refusal(frame, self.node)
        return frame

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


async def one_shot(node: Node, token: str, request: rpc.Message, reply):
    """A whole call for the small ops (flush, drain, stats); the caller bounds its time."""
    call = WorkerCall(node, token)
    try:
        await call.open()
        await call.send(request)
        return await call.recv(reply)
    finally:
        call.close()
