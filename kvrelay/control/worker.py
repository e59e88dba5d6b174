"""One request's msgpack connection to a worker, and the worker errors control tells apart."""

from __future__ import annotations

import asyncio

from kvrelay.control.registry import Node
from kvrelay.transfer.errors import PeerError, TransferError
from kvrelay.transfer.wire import WIRE_VERSION, Connection

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
    """`RequestError` (bad input) or `PoolExhausted` (never fits this worker)."""

    def __init__(self, error: str, message: str) -> None:
        super().__init__(message)
        self.error = error


def raise_for_error(reply: dict, node: Node) -> None:
    if reply.get("ok") is True:
        return
    error = str(reply.get("error", "UnknownError"))
    message = str(reply.get("message", ""))[:500]
    if error == "Busy":
        raise WorkerBusy(f"{node.node_id} is busy")
    if error in ("RequestError", "PoolExhausted"):
        raise WorkerRejected(error, message or error)
    raise WorkerFault(f"{node.node_id} answered {error}: {message}")


class WorkerCall:
    """Open, hello, then frames; `close()` is how control cancels the request."""

    def __init__(self, node: Node, token: str, connect_timeout_s: float = CONNECT_TIMEOUT_S):
        self.node = node
        self.token = token
        self.connect_timeout_s = connect_timeout_s
        self.conn: Connection | None = None

    async def open(self) -> None:
        """Connect and exchange hellos; a host that does not answer within
        `connect_timeout_s` is a fault, so it cannot eat the whole request budget."""
        host, port = self.node.address.rsplit(":", 1)
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                try:
                    self.conn = await Connection.open(host, int(port))
                except PeerError as exc:
                    raise WorkerRefused(
                        f"{self.node.node_id} at {self.node.address}: {exc}"
                    ) from None
                await self.send({"op": "hello", "v": WIRE_VERSION, "token": self.token})
                hello = await self.recv()
        except TimeoutError:
            raise WorkerFault(
                f"{self.node.node_id} did not answer the hello within {self.connect_timeout_s:g} s"
            ) from None
        if hello.get("ok") is not True:
            raise WorkerFault(f"{self.node.node_id} refused the hello: {hello.get('error')}")
        if hello.get("role") not in (None, self.node.role):
            raise WorkerFault(f"{self.node.node_id} answers as {hello.get('role')!r}")

    async def send(self, message: dict) -> None:
        try:
            await self.conn.send(message)
        except (TransferError, OSError) as exc:
            raise WorkerFault(f"{self.node.node_id}: {exc}") from None

    async def recv(self, timeout_s: float | None = None) -> dict:
        """The next frame; with `timeout_s`, a worker that takes longer is at fault."""
        try:
            async with asyncio.timeout(timeout_s):
                return await self.conn.recv()
        except (TransferError, OSError) as exc:
            raise WorkerFault(f"{self.node.node_id}: {exc}") from None
        except TimeoutError:
            # Only this timeout's own expiry lands here: an outer deadline
            # reaches us as a cancellation and passes through.
            raise WorkerFault(
                f"{self.node.node_id} did not answer within {timeout_s:g} s"
            ) from None

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


async def one_shot(node: Node, token: str, message: dict) -> dict:
    """A whole call for the small ops (flush, drain, stats); the caller bounds its time."""
    call = WorkerCall(node, token)
    try:
        await call.open()
        await call.send(message)
        reply = await call.recv()
        raise_for_error(reply, node)
        return reply
    finally:
        call.close()
