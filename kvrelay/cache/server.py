"""The cache server: a CacheTier behind msgpack control frames, pages moved by the transfer engine.

Control connection (frames of `kvrelay.transfer.wire`): first
`{"op": "hello", "v": 1, "token"}`, answered with the page size and the
transfer agent's address. Then, each answered `{"ok": true, ...}` or an error
reply:

- `lookup {keys, lease_s}` -> `hits` (length of the sealed prefix), `lease`
- `handle {lease, count, runs, ns}` -> `handle`: a block handle for the first
  `count` pages of a lookup or reservation lease, `runs` (page offsets: the
  caller's rectangle) of each
- `reserve {keys, lease_s}` -> `slots` (an int per key to write, None for a
  page already sealed or no room), `lease`
- `commit {keys, runs}` -> `sealed` per key
- `release {lease}`, `stats`, `flush {ns?}` -> `dropped`, `l3_dropped`: the
  unpinned L2 pages and the L3 pages of one namespace, or all

`lookup` and `reserve` may carry `ns`, the namespace digest, recorded with
each page so `flush` can drop one tenant's pages.

The tier is single-threaded: every op runs on the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from dataclasses import dataclass
from reprlib import repr as brief

from kvrelay.cache.arena import ArenaConfig, PageArena
from kvrelay.cache.index import CacheIndexError
from kvrelay.cache.l3 import open_store
from kvrelay.cache.tier import CacheTier, TierConfig
from kvrelay.transfer import ProtocolError, TransferError, create_agent
from kvrelay.transfer.wire import (
    MAX_HELLO_FRAME,
    WIRE_VERSION,
    Connection,
    error_reply,
    listen_socket,
    refuse,
    token_ok,
)

MAX_LEASE_S = 300.0


@dataclass(frozen=True, slots=True)
class CacheServerConfig:
    token: str
    page_bytes: int
    arena_bytes: int
    host: str = "127.0.0.1"
    port: int = 0
    backend: str = "tcp"  # transfer backend for page data: tcp or ucx
    l3: str | None = None  # file:DIR or valkey://HOST:PORT
    l3_capacity_bytes: int | None = None  # for a file L3
    l3_policy: str = "write-back"
    timeout_s: float = 10.0


class ProtocolViolation(ValueError):
    """A request with missing or mistyped fields."""


def _keys(message: dict) -> list[bytes]:
    keys = message.get("keys")
    if not isinstance(keys, list) or not all(isinstance(k, bytes) and len(k) == 32 for k in keys):
        raise ProtocolViolation("keys must be a list of 32-byte keys")
    return keys


def _runs(message: dict, page_bytes: int) -> list[tuple[int, int]]:
    runs = message.get("runs")
    if not isinstance(runs, list) or not runs:
        raise ProtocolViolation("runs must be a non-empty list of [offset, length]")
    out = []
    for run in runs:
        if (
            not isinstance(run, list | tuple)
            or len(run) != 2
            or not all(_is_int(v) for v in run)
            or run[0] < 0
            or run[1] <= 0
            or run[0] + run[1] > page_bytes
        ):
            raise ProtocolViolation(f"run {brief(run)} is not inside a page of {page_bytes} bytes")
        out.append((run[0], run[1]))
    return out


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _lease_id(message: dict) -> int:
    lease = message.get("lease")
    if not _is_int(lease):
        raise ProtocolViolation(f"lease must be an integer, got {brief(lease)}")
    return lease


def _namespace(message: dict, required: bool = False) -> bytes | None:
    namespace = message.get("ns")
    if namespace is None and not required:
        return None
    if not isinstance(namespace, bytes) or len(namespace) != 32:
        raise ProtocolViolation("ns must be a 32-byte namespace digest")
    return namespace


def _lease_s(message: dict) -> float:
    lease_s = message.get("lease_s", 30.0)
    ok = isinstance(lease_s, int | float) and not isinstance(lease_s, bool)
    if not ok or not 0 < lease_s <= MAX_LEASE_S:
        raise ProtocolViolation(f"lease_s must be in (0, {MAX_LEASE_S}]")
    return float(lease_s)


class CacheServer:
    def __init__(self, config: CacheServerConfig) -> None:
        self.config = config
        self.agent = None
        self.tier: CacheTier | None = None
        # lease id -> keys in request order that the lease covers (its pinned pages).
        self._lease_keys: dict[int, list[bytes]] = {}
        # tier lease id -> transfer leases of handles published under it.
        self._handle_leases: dict[int, list[int]] = {}
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task] = set()
        self._ops = 0
        self.address = ""

    async def start(self) -> CacheServer:
        c = self.config
        self.agent = await create_agent(c.backend, token=c.token, host=c.host, timeout=c.timeout_s)
        arena = PageArena(self.agent, ArenaConfig(c.page_bytes, capacity_bytes=c.arena_bytes))
        l3 = open_store(c.l3, capacity_bytes=c.l3_capacity_bytes) if c.l3 else None
        self.tier = CacheTier(arena, l3, TierConfig(l3_policy=c.l3_policy))
        self._listener, self.address = listen_socket(c.host, c.port)
        self._accept = asyncio.create_task(self._accept_loop())
        return self

    async def close(self) -> None:
        tasks = [self._accept, *self._tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._listener.close()
        if self.tier.l3 is not None:
            # A graceful stop keeps write-back pages: a restart promotes them.
            self.tier.demote_all()
            self.tier.l3.close()
        await self.agent.close()

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(self._listener)
            task = asyncio.create_task(self._serve(Connection(sock)))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, conn: Connection) -> None:
        try:
            hello = await asyncio.wait_for(conn.recv(MAX_HELLO_FRAME), self.config.timeout_s)
            if hello.get("op") != "hello" or not token_ok(hello.get("token"), self.config.token):
                await conn.send({"ok": False, "error": "AuthError", "message": "bad token"})
                return
            if hello.get("v") != WIRE_VERSION:
                await conn.send({"ok": False, "error": "ProtocolError", "message": "version"})
                return
            await conn.send(
                {"ok": True, "page_bytes": self.config.page_bytes, "agent": self.agent.address}
            )
            while True:
                message = await conn.recv(stall_timeout=self.config.timeout_s)
                try:
                    reply = self.handle(message)
                except (ProtocolViolation, CacheIndexError, TransferError, ValueError) as exc:
                    reply = error_reply(exc)
                await conn.send(reply)
        except ProtocolError as exc:
            await refuse(conn, exc)
        except (TransferError, TimeoutError, OSError):
            pass  # the client went away or spoke garbage: drop the connection
        finally:
            conn.close()

    def handle(self, message: dict) -> dict:
        op = message.get("op")
        tier = self.tier
        self._ops += 1
        if self._ops % 256 == 0:
            self._forget_dead_leases()
        if op == "lookup":
            hit = tier.lookup(_keys(message), _lease_s(message), _namespace(message) or b"")
            lease = hit.lease.lease_id if hit.lease else None
            if lease is not None:
                self._lease_keys[lease] = [e.key for e in hit.entries]
            return {"ok": True, "hits": hit.hits, "lease": lease}
        if op == "reserve":
            keys = _keys(message)
            slots, lease = tier.reserve(keys, _lease_s(message), _namespace(message) or b"")
            self._lease_keys[lease.lease_id] = [
                k for k, s in zip(keys, slots, strict=True) if s is not None
            ]
            return {"ok": True, "slots": slots, "lease": lease.lease_id}
        if op == "handle":
            return self._publish(message)
        if op == "commit":
            runs = _runs(message, self.config.page_bytes)
            return {"ok": True, "sealed": [tier.commit(k, runs) for k in _keys(message)]}
        if op == "release":
            lease = _lease_id(message)
            released = tier.release(lease)
            self._lease_keys.pop(lease, None)
            for handle_lease in self._handle_leases.pop(lease, []):
                self.agent.leases.release(handle_lease)
            return {"ok": True, "released": bool(released)}
        if op == "stats":
            stats = {"tier": dataclasses.asdict(tier.stats), "pages": len(tier.index)}
            if tier.l3 is not None:
                stats["l3"] = dataclasses.asdict(tier.l3.stats)
            return {"ok": True, **stats}
        if op == "flush":
            l2, l3 = tier.flush(_namespace(message))
            return {"ok": True, "dropped": l2, "l3_dropped": l3}
        raise ProtocolViolation(f"unknown op {brief(op)}")

    def _forget_dead_leases(self) -> None:
        for lease in [lid for lid in self._lease_keys if self.tier.index.lease(lid) is None]:
            del self._lease_keys[lease]
            self._handle_leases.pop(lease, None)

    def _publish(self, message: dict) -> dict:
        lease = _lease_id(message)
        count = message.get("count")
        namespace = _namespace(message, required=True)
        keys = self._lease_keys.get(lease)
        live = self.tier.index.lease(lease) if keys is not None else None
        if live is None:
            raise ProtocolViolation(f"lease {brief(lease)} is unknown or expired")
        if not _is_int(count) or not 0 < count <= len(keys):
            raise ProtocolViolation(f"count must be in [1, {len(keys)}]")
        page_runs = _runs(message, self.config.page_bytes)
        arena = self.tier.arena
        runs = []
        for key in keys[:count]:
            runs += arena.runs(self.tier.index.get(key).location.slot, page_runs)
        # The handle lives as long as the pins that keep its slots from reuse.
        remaining = self.tier.index.seconds_left(live)
        handle = self.agent.publish(arena.arena, runs, namespace, max(remaining, 0.001))
        self._handle_leases.setdefault(lease, []).append(handle.lease_id)
        return {"ok": True, "handle": handle.to_bytes()}
