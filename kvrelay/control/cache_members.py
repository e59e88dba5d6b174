"""Cache servers that join and leave a running cluster: registration, heartbeats,
and the ring control publishes with a version.

The ring is the static `--cache` list plus every registered server in state
`live`. A server that registers, drains, deregisters or misses
`MISSED_HEARTBEATS` heartbeats changes the ring, and the version goes up by
one. Every registration and heartbeat reply carries the ring; cache servers
answer it to their clients (`GetRing`), so clients move to a new version on
their next poll. Control's own tier probe follows it at once.
"""

from __future__ import annotations

import enum
import itertools
import secrets
import time
from dataclasses import dataclass

from fastapi import FastAPI, HTTPException
from pydantic import Field, field_validator

from kvrelay.control.openapi import AUTH, BAD_REQUEST, UNKNOWN_NODE
from kvrelay.control.registry import MISSED_HEARTBEATS
from kvrelay.control.schemas import _ADDRESS, ADDRESS_PATTERN, _Strict
from kvrelay.control.tier import TierProbe


class MemberState(enum.StrEnum):
    LIVE = "live"
    DRAINING = "draining"  # out of the ring, still serving what is in flight


@dataclass(slots=True)
class CacheMember:
    server_id: str
    address: str
    last_heartbeat: float
    state: MemberState = MemberState.LIVE


class CacheMembers:
    def __init__(self, static: tuple[str, ...], heartbeat_s: float, clock=time.monotonic) -> None:
        self.static = tuple(static)
        self.heartbeat_s = heartbeat_s
        self.clock = clock
        self.members: dict[str, CacheMember] = {}
        self.version = 1
        self._ids = itertools.count(1)
        self._servers = self._live()
        self.listeners: list = []  # called with the new servers on every change

    def _live(self) -> list[str]:
        registered = [m.address for m in self.members.values() if m.state is MemberState.LIVE]
        return sorted(set(self.static) | set(registered))

    @property
    def servers(self) -> list[str]:
        return list(self._servers)

    def ring(self) -> dict:
        return {"version": self.version, "servers": self.servers}

    def _changed(self) -> None:
        servers = self._live()
        if servers != self._servers:
            self._servers = servers
            self.version += 1
            for listener in self.listeners:
                listener(servers)

    def register(self, address: str) -> CacheMember:
        # A server restarted on the same address replaces its old entry.
        for old in [m for m in self.members.values() if m.address == address]:
            del self.members[old.server_id]
        member = CacheMember(
            f"cache-{next(self._ids)}-{secrets.token_hex(3)}", address, self.clock()
        )
        self.members[member.server_id] = member
        self._changed()
        return member

    def heartbeat(self, server_id: str) -> bool:
        member = self.members.get(server_id)
        if member is None:
            return False
        member.last_heartbeat = self.clock()
        return True

    def drain(self, server_id: str) -> bool:
        member = self.members.get(server_id)
        if member is None:
            return False
        member.state = MemberState.DRAINING
        self._changed()
        return True

    def deregister(self, server_id: str) -> bool:
        if self.members.pop(server_id, None) is None:
            return False
        self._changed()
        return True

    def sweep(self) -> list[str]:
        """Remove servers that missed MISSED_HEARTBEATS heartbeats; their ids."""
        deadline = self.clock() - MISSED_HEARTBEATS * self.heartbeat_s
        gone = [m.server_id for m in self.members.values() if m.last_heartbeat < deadline]
        for server_id in gone:
            del self.members[server_id]
        if gone:
            self._changed()
        return gone

    def describe(self) -> list[dict]:
        now = self.clock()
        return [
            {"server_id": m.server_id, "address": m.address, "state": m.state,
             "heartbeat_age_s": round(now - m.last_heartbeat, 3)}
            for m in self.members.values()
        ]  # fmt: skip


class CacheServerRegistration(_Strict):
    address: str = Field(max_length=259, json_schema_extra={"pattern": ADDRESS_PATTERN})

    @field_validator("address")
    @classmethod
    def _address(cls, value: str) -> str:
        if not _ADDRESS.fullmatch(value):
            raise ValueError("address must be host:port with a port in 1-65535")
        return value


def add_cache_routes(app: FastAPI, members: CacheMembers, tier: TierProbe, admin) -> None:
    """Cache servers register, heartbeat, drain and deregister (cluster token);
    anyone with the token reads the ring."""
    members.listeners.append(tier.set_servers)
    app.state.cache_members = members

    def reply(member: CacheMember) -> dict:
        return {"server_id": member.server_id, "heartbeat_s": members.heartbeat_s,
                "ring": members.ring()}  # fmt: skip

    @app.post("/v1/cache-servers", dependencies=admin, responses=BAD_REQUEST | AUTH)
    async def register_cache(body: CacheServerRegistration) -> dict:
        return reply(members.register(body.address))

    @app.post("/v1/cache-servers/{server_id}/heartbeat", dependencies=admin,
              responses=AUTH | UNKNOWN_NODE)  # fmt: skip
    async def cache_heartbeat(server_id: str) -> dict:
        if not members.heartbeat(server_id):
            raise HTTPException(404, f"unknown cache server {server_id}: register again")
        return reply(members.members[server_id])

    @app.post("/v1/cache-servers/{server_id}/drain", dependencies=admin,
              responses=AUTH | UNKNOWN_NODE)  # fmt: skip
    async def drain_cache(server_id: str) -> dict:
        if not members.drain(server_id):
            raise HTTPException(404, f"unknown cache server {server_id}")
        return reply(members.members[server_id])

    @app.delete("/v1/cache-servers/{server_id}", dependencies=admin,
                responses=AUTH | UNKNOWN_NODE)  # fmt: skip
    async def deregister_cache(server_id: str) -> dict:
        if not members.deregister(server_id):
            raise HTTPException(404, f"unknown cache server {server_id}")
        return {"ring": members.ring()}

    @app.get("/v1/cache-ring", dependencies=admin, responses=AUTH)
    async def cache_ring() -> dict:
        return members.ring() | {"members": members.describe()}
