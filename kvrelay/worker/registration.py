"""Registration with control and heartbeats (HTTP, bearer token), per
`docs/serving-protocol.md`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Annotated

import httpx
import msgspec

log = logging.getLogger("kvrelay.worker")


class Registered(msgspec.Struct):
    """Control's answer to a registration (`POST /v1/nodes`)."""

    node_id: str
    heartbeat_s: Annotated[float, msgspec.Meta(gt=0)]


class Registrar:
    def __init__(
        self,
        control_url: str,
        token: str,
        body: dict,
        status: Callable[[], Awaitable[dict]],
        *,
        timeout_s: float = 5.0,
    ) -> None:
        self.url = control_url.rstrip("/")
        self.body = body
        self.status = status
        self.node_id: str | None = None
        self.heartbeat_s = 1.0
        self._client = httpx.AsyncClient(
            headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s
        )

    async def register(self, deadline_s: float = 60.0) -> str:
        """POST /v1/nodes until control answers (it may start after us)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        while True:
            try:
                reply = await self._client.post(f"{self.url}/v1/nodes", json=self.body)
                if reply.status_code == 200:
                    answer = msgspec.json.decode(reply.content, type=Registered)
                    self.node_id, self.heartbeat_s = answer.node_id, answer.heartbeat_s
                    return self.node_id
                why = f"HTTP {reply.status_code}: {reply.text[:200]}"
                if 400 <= reply.status_code < 500:
                    # Refused (bad token, bad body): retrying will not help.
                    raise RuntimeError(f"control refused the registration: {why}")
            except (httpx.HTTPError, msgspec.DecodeError) as exc:
                why = repr(exc)
            if loop.time() > end:
                raise RuntimeError(f"could not register with control at {self.url}: {why}")
            await asyncio.sleep(0.5)

    async def heartbeats(self) -> None:
        """Runs until cancelled; registers again when control forgot the node."""
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                body = await self.status()
                url = f"{self.url}/v1/nodes/{self.node_id}/heartbeat"
                reply = await self._client.post(url, json=body)
                if reply.status_code == 404:
                    await self.register()
            except (httpx.HTTPError, RuntimeError) as exc:
                log.warning("heartbeat to %s failed: %r", self.url, exc)

    async def deregister(self) -> None:
        if self.node_id is None:
            return
        try:
            await self._client.delete(f"{self.url}/v1/nodes/{self.node_id}", timeout=2.0)
        except httpx.HTTPError as exc:
            log.warning("deregistration from %s failed: %r", self.url, exc)
        self.node_id = None

    async def close(self) -> None:
        await self._client.aclose()
