"""Keeping tenants apart on a cache server.

A tenant's clients hold a token scoped to its namespace (`rpc.scope`); the
server's hello records the scope on the connection and every request is
checked against it here: a request naming another namespace, a lease taken in
another namespace, stats (counters of every tenant) and a flush of every
namespace are refused with a typed `ScopeError`. Peers of the cluster token
(kvrelay's own processes, operators) may touch every namespace.

Inside the server a page's key is `tenant_key(ns, key)`, a keyed digest of the
namespace and the client's key: two tenants' keys never meet in the index, so
a client of one cannot hit, pin, seal or probe a page of another even when it
sends the very same key (the sglang key scheme does not root keys in the
namespace), and L3 files pages under the same derived key.
"""

from __future__ import annotations

import argparse
import hashlib
from collections.abc import Sequence

from kvrelay.cache.l3.record import normalize_namespace
from kvrelay.rpc import AuthError, Scope, scoped_token


class ScopeError(AuthError):
    """A request outside the namespaces the connection's token allows."""


def tenant_key(namespace: bytes | None, key: bytes) -> bytes:
    """The server-side key of `key` in `namespace` (None and b"": no namespace)."""
    return hashlib.blake2b(key, digest_size=32, key=normalize_namespace(namespace or b"")).digest()


def tenant_keys(namespace: bytes | None, keys: Sequence[bytes]) -> list[bytes]:
    """`tenant_key` of each key: the keyed state is set up once and copied."""
    keyed = hashlib.blake2b(digest_size=32, key=normalize_namespace(namespace or b""))
    out = []
    for key in keys:
        digest = keyed.copy()
        digest.update(key)
        out.append(digest.digest())
    return out


def check_namespace(scope: Scope, namespace: bytes | None) -> None:
    if not scope.allows(namespace):
        raise ScopeError("this token does not allow that namespace")


def check_every_namespace(scope: Scope, what: str) -> None:
    if not scope.every_namespace:
        raise ScopeError(f"{what} needs the cluster token")


def add_token_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--token", required=True, help="the cluster token")
    parser.add_argument(
        "--namespace", required=True, help="the namespace digest, 64 hex digits (ModelKVSpec)"
    )


def run_token(args: argparse.Namespace) -> None:
    """Print the tenant-scoped token of one namespace."""
    try:
        namespace = bytes.fromhex(args.namespace)
        print(scoped_token(args.token, namespace))
    except ValueError as exc:
        raise SystemExit(f"kvrelay tenant-token: {exc}") from None
