"""A cache server's membership in a running cluster: it registers with control,
heartbeats, learns the published ring, and drains before it leaves.

Control answers every registration and heartbeat with the ring (`version`,
`servers`); the server keeps the latest and answers it to its clients
(`GetRing`), which is how clients learn that the ring changed. A heartbeat
that control answers 404 (it forgot the server, or restarted) registers
again. Control unreachable leaves the last ring in place.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated

import httpx
import msgspec

log = logging.getLogger("kvrelay.cache")


class Ring(msgspec.Struct, frozen=True):
    version: Annotated[int, msgspec.Meta(ge=0)]
    servers: list[str]


class Membership(msgspec.Struct):
    server_id: str
    heartbeat_s: Annotated[float, msgspec.Meta(gt=0)]
    ring: Ring


# Before the first answer from control: no ring (clients keep their own list).
NO_RING = Ring(0, [])


class ControlLink:
    def __init__(self, control_url: str, token: str, address: str, timeout_s: float = 5.0) -> None:
        self.url = control_url.rstrip("/")
        self.address = address
        self.server_id: str | None = None
        self.heartbeat_s = 1.0
        self.ring = NO_RING
        self.on_new_ring = None  # called with each newer ring control answers
        self._client = httpx.AsyncClient(
            headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s
        )

    def _take(self, reply: httpx.Response) -> None:
        answer = msgspec.json.decode(reply.content, type=Membership)
        self.server_id, self.heartbeat_s = answer.server_id, answer.heartbeat_s
        if answer.ring.version > self.ring.version:
            known = self.ring.version > 0
            self.ring = answer.ring
            if known and self.on_new_ring is not None:
                self.on_new_ring(answer.ring)

    async def register(self, deadline_s: float = 60.0) -> str:
        """POST /v1/cache-servers until control answers (it may start after us)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        while True:
            try:
                reply = await self._client.post(
                    f"{self.url}/v1/cache-servers", json={"address": self.address}
                )
                if reply.status_code == 200:
                    self._take(reply)
                    return self.server_id
                why = f"HTTP {reply.status_code}: {reply.text[:200]}"
                if 400 <= reply.status_code < 500:
                    raise RuntimeError(f"control refused the cache server: {why}")
            except (httpx.HTTPError, msgspec.DecodeError) as exc:
                why = repr(exc)
            if loop.time() > end:
                raise RuntimeError(f"could not register with control at {self.url}: {why}")
            await asyncio.sleep(0.5)

    async def heartbeats(self) -> None:
        """Runs until cancelled."""
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                reply = await self._client.post(
                    f"{self.url}/v1/cache-servers/{self.server_id}/heartbeat"
                )
                if reply.status_code == 404:
                    await self.register()
                elif reply.status_code == 200:
                    self._take(reply)
            except (httpx.HTTPError, msgspec.DecodeError, RuntimeError) as exc:
                log.warning("heartbeat to %s failed: %r", self.url, exc)

    async def drain(self) -> bool:
        """Leave the ring (control publishes a version without this server)."""
        try:
            reply = await self._client.post(f"{self.url}/v1/cache-servers/{self.server_id}/drain")
        except httpx.HTTPError as exc:
            log.warning("drain at %s failed: %r", self.url, exc)
            return False
        if reply.status_code == 200:
            self._take(reply)
        return reply.status_code == 200

    async def deregister(self) -> None:
        try:
            await self._client.delete(f"{self.url}/v1/cache-servers/{self.server_id}", timeout=2.0)
        except httpx.HTTPError as exc:
            log.warning("deregistration from %s failed: %r", self.url, exc)

    async def close(self) -> None:
        await self._client.aclose()
