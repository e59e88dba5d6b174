"""The identities a cache server's namespaces were made from.

A namespace is the sha256 of its identity fields (`ModelKVSpec.identity_fields`:
model, weights, dtype, page size, widths, key scheme, ...). Clients announce
their spec's fields when they connect; the server checks that they hash to
the namespace and keeps them, so that two engines serving one model that
share no pages can be told why: a client's reply names the namespaces of the
same model (same `model_id`, or the same non-empty weights fingerprint) and
the fields each differs in, with its page count, and `kvrelay namespaces`
lists every namespace with its fields and pages.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter, OrderedDict

import msgpack

log = logging.getLogger("kvrelay.cache.client")

# Namespaces remembered per server (the oldest announced goes first).
MAX_NAMESPACES = 4096


def namespace_of(identity: dict) -> bytes:
    """The namespace `identity` names (as `ModelKVSpec.namespace` hashes it)."""
    return hashlib.sha256(msgpack.packb(identity, use_bin_type=True)).digest()


def differing(a: dict, b: dict) -> list[str]:
    """Fields whose values differ (present in one only counts)."""
    return sorted(k for k in set(a) | set(b) if k != "layout_version" and a.get(k) != b.get(k))


def same_model(a: dict, b: dict) -> bool:
    fingerprint = a.get("weights_fingerprint")
    return a.get("model_id") == b.get("model_id") or (
        bool(fingerprint) and fingerprint == b.get("weights_fingerprint")
    )


class NamespaceBook:
    def __init__(self, limit: int = MAX_NAMESPACES) -> None:
        self.limit = limit
        self.identities: OrderedDict[bytes, dict] = OrderedDict()

    def record(self, namespace: bytes, identity: dict) -> bool:
        """Keep `identity` for `namespace`; False (nothing kept) when it does not hash to it."""
        if namespace_of(identity) != namespace:
            return False
        self.identities[namespace] = identity
        self.identities.move_to_end(namespace)
        while len(self.identities) > self.limit:
            self.identities.popitem(last=False)
        return True

    @staticmethod
    def page_counts(entries) -> Counter:
        return Counter(entry.namespace for entry in entries)

    def near(
        self, namespace: bytes, allows, counts: Counter
    ) -> list[tuple[bytes, dict, int, list]]:
        """Other namespaces of the same model `allows` lets the caller see:
        (namespace, identity, pages, differing fields)."""
        mine = self.identities.get(namespace)
        if mine is None:
            return []
        return [
            (ns, identity, counts.get(ns, 0), differing(mine, identity))
            for ns, identity in self.identities.items()
            if ns != namespace and allows(ns) and same_model(mine, identity)
        ]

    def listing(self, counts: Counter) -> list[tuple[bytes, dict | None, int]]:
        """Every namespace with pages or a known identity: (namespace, identity, pages)."""
        spaces = list(self.identities) + [ns for ns in counts if ns not in self.identities]
        return [(ns, self.identities.get(ns), counts.get(ns, 0)) for ns in spaces]


class IdentityNotes:
    """A cache client's side: it announces its spec's fields to each server
    once and logs, once each, the server's namespaces of the same model that
    differ from its own and page sizes a server refuses."""

    def __init__(self, spec) -> None:
        self.spec, self.namespace = spec, spec.namespace()
        self.announced: set[str] = set()
        self.told: set = set()

    async def announce(self, server: str, channel) -> None:
        from kvrelay.rpc.cache_ops import Announce, AnnounceReply

        if server in self.announced:
            return
        self.announced.add(server)
        try:
            reply = await channel.call(
                Announce(self.namespace, self.spec.identity_fields()), AnnounceReply
            )
        except Exception:  # an older server, or none: nothing to learn
            return
        for near in reply.near:
            if near.ns not in self.told:
                self.told.add(near.ns)
                log.warning(
                    "kvrelay cache: namespace %s of %s shares no pages with namespace %s of "
                    "the same model on %s (%d pages): they differ in %s",
                    self.namespace.hex()[:16], self.spec.model_id, near.ns.hex()[:16], server,
                    near.pages, ", ".join(near.differs) or "nothing named",
                )  # fmt: skip

    def refused(self, server_bytes: int, own_bytes: int) -> str:
        problem = f"it holds pages of {server_bytes} bytes, not {own_bytes}"
        if server_bytes not in self.told:
            self.told.add(server_bytes)
            log.warning(
                "kvrelay cache: a server refused namespace %s of %s: %s (page size %d tokens, "
                "%s): no page is shared; engines sharing pages need the server's page size, "
                "dtype and geometry",
                self.namespace.hex()[:16], self.spec.model_id, problem, self.spec.page_size,
                self.spec.kv_dtype,
            )  # fmt: skip
        return problem


def _shown(identity: dict | None) -> dict | None:
    if identity is None:
        return None
    return {k: v.hex() if isinstance(v, bytes) else v for k, v in identity.items()}


async def list_namespaces(servers, token: str, timeout_s: float = 5.0) -> dict[str, list | None]:
    """Each server's namespaces as dicts (namespace hex, pages, identity fields);
    None for a server that did not answer."""
    from kvrelay.rpc import Channel, Unavailable
    from kvrelay.rpc.cache_ops import CacheWelcome, ListNamespaces, NamespacesReply

    out: dict[str, list | None] = {}
    for server in servers:
        channel = Channel(server, token, CacheWelcome, timeout_s)
        try:
            reply = await channel.call(ListNamespaces(), NamespacesReply)
            out[server] = [
                {"namespace": n.ns.hex(), "pages": n.pages, "identity": _shown(n.identity)}
                for n in reply.namespaces
            ]
        except Unavailable:
            out[server] = None
        finally:
            channel.drop()
    return out


def add_arguments(parser) -> None:
    parser.add_argument("--servers", required=True, help="cache servers, host:port,host:port")
    parser.add_argument("--token", required=True, help="the cluster token")
    parser.add_argument("--timeout-s", type=float, default=5.0)


def run(args) -> None:
    import asyncio
    import json

    servers = [s for s in args.servers.split(",") if s]
    print(json.dumps(asyncio.run(list_namespaces(servers, args.token, args.timeout_s)), indent=1))
