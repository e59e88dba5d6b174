"""Registered workers, their heartbeats, liveness and what control knows of their pools.

States: `live` (in rotation), `suspect` (its dispatch connection failed or
timed out: out of rotation until its next heartbeat proves it alive),
`draining` (asked to finish in-flight work; never chosen again). A node
whose connection was refused, or that missed `MISSED_HEARTBEATS`
heartbeats, is removed: its next heartbeat gets 404 and it registers again.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import secrets
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

MISSED_HEARTBEATS = 3


class NodeState(enum.StrEnum):
    LIVE = "live"
    SUSPECT = "suspect"
    DRAINING = "draining"


MAX_ESTIMATE_PAGES = 1 << 20  # keys remembered per node, whatever its pool claims
COUNTER_NAMES = (
    "requests", "prompt_tokens", "computed_tokens", "local_hit_tokens", "tier_hit_tokens",
    "generated_tokens", "bytes_from_tier", "bytes_to_tier", "bytes_from_prefill",
    "busy_rejections", "errors", "writeback_skipped_pages",
    # Speculative decoding (decode workers with --speculative): draft tokens
    # proposed and accepted, verify steps.
    "spec_proposed", "spec_accepted", "spec_steps",
)  # fmt: skip


class PageEstimate:
    """An LRU set of page keys control sent to one worker, bounded by its pool.

    It only estimates what the pool holds (the worker may have evicted
    pages, or holds pages control never saw), which is enough to route a
    shared prefix back to the worker that most likely still has it.
    """

    __slots__ = ("capacity", "keys")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys: OrderedDict[bytes, None] = OrderedDict()

    def hit(self, keys: Sequence[bytes]) -> int:
        """Leading keys present (a prefix hit counts only from the start)."""
        count = 0
        for key in keys:
            if key not in self.keys:
                break
            count += 1
        return count

    def add(self, keys: Sequence[bytes]) -> None:
        for key in keys[: self.capacity]:
            self.keys[key] = None
            self.keys.move_to_end(key)
        while len(self.keys) > self.capacity:
            self.keys.popitem(last=False)

    def clear(self) -> None:
        self.keys.clear()


@dataclass(slots=True)
class Node:
    node_id: str
    role: str
    address: str
    model: str
    namespace: bytes
    page_size: int
    vocab_size: int
    tp: int
    pp: int
    num_pages: int
    cache: bool
    registered_at: float
    last_heartbeat: float
    estimate: PageEstimate
    state: NodeState = NodeState.LIVE
    queued: int = 0
    active: int = 0
    free_pages: int = 0
    inflight: int = 0  # requests control has open on this node right now
    counters: dict[str, float] = field(default_factory=dict)
    model_dir: str = ""  # where the worker loads the model (tokenizer files), if sent
    key_scheme: str = "kvrelay"  # how its page keys derive from tokens

    @property
    def load(self) -> int:
        return self.queued + self.active + self.inflight

    def describe(self) -> dict:
        return {
            "node_id": self.node_id, "role": self.role, "address": self.address,
            "model": self.model, "namespace": self.namespace.hex(), "page_size": self.page_size,
            "key_scheme": self.key_scheme,
            "vocab_size": self.vocab_size, "tp": self.tp, "pp": self.pp,
            "num_pages": self.num_pages, "cache": self.cache, "state": self.state,
            "queued": self.queued, "active": self.active, "inflight": self.inflight,
            "free_pages": self.free_pages, "estimated_pages": len(self.estimate.keys),
            "heartbeat_age_s": round(time.monotonic() - self.last_heartbeat, 3),
            "counters": dict(self.counters),
        }  # fmt: skip


class Registry:
    def __init__(self, heartbeat_s: float, clock=time.monotonic) -> None:
        self.heartbeat_s = heartbeat_s
        self.clock = clock
        self.nodes: dict[str, Node] = {}
        self.removed: dict[str, int] = {"expired": 0, "refused": 0, "deregistered": 0}
        # Counters of nodes that left, so totals over the cluster never go back.
        self.retired_counters: dict[str, float] = dict.fromkeys(COUNTER_NAMES, 0)
        self._ids = itertools.count(1)
        self._capacity: asyncio.Event | None = None

    def capacity_changed(self) -> None:
        """A node may take work now (a heartbeat, a new node, a request of
        control's ended on it): wake the requests waiting for one."""
        if self._capacity is not None:
            self._capacity.set()
            self._capacity = None

    async def wait_for_capacity(self) -> None:
        """Until the next `capacity_changed` (the caller bounds the wait)."""
        if self._capacity is None:
            self._capacity = asyncio.Event()
        await self._capacity.wait()

    def register(self, *, role: str, address: str, model: str, namespace: bytes,
                 page_size: int, vocab_size: int, tp: int, pp: int, num_pages: int,
                 cache: bool, model_dir: str = "",
                 key_scheme: str = "kvrelay") -> Node:  # fmt: skip
        # A worker restarted on the same address replaces its old entry.
        for old in [n for n in self.nodes.values() if n.address == address and n.role == role]:
            self._remove(old.node_id, "deregistered")
        now = self.clock()
        node_id = f"{role}-{next(self._ids)}-{secrets.token_hex(3)}"
        node = Node(
            node_id=node_id, role=role, address=address, model=model, namespace=namespace,
            page_size=page_size, vocab_size=vocab_size, tp=tp, pp=pp, num_pages=num_pages,
            cache=cache, registered_at=now, last_heartbeat=now,
            estimate=PageEstimate(min(num_pages, MAX_ESTIMATE_PAGES)), free_pages=num_pages,
            model_dir=model_dir, key_scheme=key_scheme,
        )  # fmt: skip
        self.nodes[node_id] = node
        self.capacity_changed()
        return node

    def heartbeat(self, node_id: str, queued: int, active: int, free_pages: int,
                  counters: dict) -> bool:  # fmt: skip
        node = self.nodes.get(node_id)
        if node is None:
            return False
        node.last_heartbeat = self.clock()
        node.queued, node.active, node.free_pages = queued, active, free_pages
        node.counters = {k: v for k, v in counters.items() if isinstance(v, int | float)}
        if node.state is NodeState.SUSPECT:
            node.state = NodeState.LIVE
        self.capacity_changed()
        return True

    def deregister(self, node_id: str) -> bool:
        return self._remove(node_id, "deregistered")

    def suspect(self, node: Node) -> None:
        if node.state is NodeState.LIVE:
            node.state = NodeState.SUSPECT

    def refused(self, node: Node) -> None:
        self._remove(node.node_id, "refused")

    def drain(self, node_id: str) -> Node | None:
        node = self.nodes.get(node_id)
        if node is not None:
            node.state = NodeState.DRAINING
        return node

    def sweep(self) -> list[str]:
        """Remove nodes that missed MISSED_HEARTBEATS heartbeats; their ids."""
        deadline = self.clock() - MISSED_HEARTBEATS * self.heartbeat_s
        gone = [n.node_id for n in self.nodes.values() if n.last_heartbeat < deadline]
        for node_id in gone:
            self._remove(node_id, "expired")
        return gone

    def _remove(self, node_id: str, why: str) -> bool:
        node = self.nodes.pop(node_id, None)
        if node is None:
            return False
        self.removed[why] += 1
        for name in COUNTER_NAMES:
            self.retired_counters[name] += node.counters.get(name, 0)
        return True

    def in_rotation(self, role: str, model: str) -> list[Node]:
        return [n for n in self.nodes.values()
                if n.role == role and n.model == model and n.state is NodeState.LIVE]  # fmt: skip

    def models(self) -> dict[str, dict]:
        """Served models: vocabulary (the smallest over its nodes) and node counts."""
        models: dict[str, dict] = {}
        for node in self.nodes.values():
            entry = models.setdefault(
                node.model, {"vocab_size": node.vocab_size, "prefill": 0, "decode": 0,
                             "namespace": node.namespace, "page_size": node.page_size,
                             "model_dir": node.model_dir},
            )  # fmt: skip
            entry["vocab_size"] = min(entry["vocab_size"], node.vocab_size)
            if node.state is NodeState.LIVE:
                entry[node.role] += 1
        return models

    def counter_totals(self) -> dict[str, float]:
        totals = dict(self.retired_counters)
        for node in self.nodes.values():
            for name in COUNTER_NAMES:
                totals[name] += node.counters.get(name, 0)
        return totals
