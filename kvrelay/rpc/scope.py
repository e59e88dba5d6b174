"""Tenant-scoped tokens: a credential for one namespace, derived from the cluster token.

`scoped_token(cluster_token, ns)` is `kvrelay-ns:<ns hex>:<HMAC-SHA256(cluster
token, "kvrelay-namespace" || ns) hex>`. A server that takes scoped peers
admits it as a peer of that namespace only (`Scope(ns)`); the cluster token
itself admits a peer of every namespace (`Scope(None)`, operators and
kvrelay's own processes). Deriving the credential needs no table on any
server, so a cache server that joins at runtime admits the same tenants as
the others; holding one namespace's token reveals nothing of another's.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

PREFIX = "kvrelay-ns:"
NAMESPACE_BYTES = 32
_LABEL = b"kvrelay-namespace"


@dataclass(frozen=True, slots=True)
class Scope:
    """What an authenticated peer may touch: one namespace, or all (None)."""

    namespace: bytes | None

    @property
    def every_namespace(self) -> bool:
        return self.namespace is None

    def allows(self, namespace: bytes | None) -> bool:
        return self.namespace is None or namespace == self.namespace


EVERY_NAMESPACE = Scope(None)


def _mac(cluster_token: str, namespace: bytes) -> str:
    return hmac.new(cluster_token.encode(), _LABEL + namespace, hashlib.sha256).hexdigest()


def scoped_token(cluster_token: str, namespace: bytes) -> str:
    """The credential of `namespace` (a 32-byte digest) under `cluster_token`."""
    if not cluster_token:
        raise ValueError("a scoped token needs a non-empty cluster token")
    if not isinstance(namespace, bytes) or len(namespace) != NAMESPACE_BYTES:
        raise ValueError(f"a namespace is {NAMESPACE_BYTES} bytes, got {namespace!r:.80}")
    return f"{PREFIX}{namespace.hex()}:{_mac(cluster_token, namespace)}"


def token_scope(given: str, cluster_token: str, *, scoped: bool = True) -> Scope | None:
    """The scope `given` grants under `cluster_token`, or None when it grants nothing
    (scoped tokens grant nothing unless `scoped`). Compared in constant time."""
    if hmac.compare_digest(given.encode(), cluster_token.encode()):
        return EVERY_NAMESPACE
    if not scoped or not given.startswith(PREFIX):
        return None
    ns_hex, _, mac = given[len(PREFIX) :].partition(":")
    try:
        namespace = bytes.fromhex(ns_hex)
    except ValueError:
        return None
    if len(namespace) != NAMESPACE_BYTES:
        return None
    if not hmac.compare_digest(mac.encode(), _mac(cluster_token, namespace).encode()):
        return None
    return Scope(namespace)
