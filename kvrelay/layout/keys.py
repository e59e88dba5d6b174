"""Page keys: a sha256 chain over full pages of tokens, rooted at a namespace.

Two key schemes (a spec's `key_scheme`, part of its namespace):

* "kvrelay" (the default):

      key[-1] = namespace
      key[i]  = sha256(key[i-1] || tokens of page i as uint32 little-endian)

* "sglang", the keys SGLang's HiCache storage backend (`kvrelay.adapters.sglang`)
  gives the pages SGLang writes, so kvrelay's own workers hit them from token
  ids. SGLang's chain (`get_hash_str`, published with SGLang) has no namespace
  at its root; kvrelay roots each of its digests in the namespace:

      link[-1] = b"" (SGLang's unseeded chain: requests without extra_key / cache_salt)
      link[i]  = sha256(link[i-1] || tokens of page i as uint32 little-endian)
      key[i]   = sha256(namespace || SGLANG_KEY_TAG || link[i])

A key names content (model identity + every token before and in the page), never
a writer, so the same prefix has the same keys under any parallel config.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from kvrelay.layout.spec import DIGEST_BYTES, KEY_SCHEMES, LayoutError

_UINT32_MAX = 2**32 - 1

# Separates SGLang-chain keys from kvrelay's own chain.
SGLANG_KEY_TAG = b"sglang-hicache-page-v1"


def tokens_as_uint32(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a little-endian uint32 array; ids outside uint32 are an error."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise LayoutError(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype="<u4")
    if not np.issubdtype(arr.dtype, np.integer):
        raise LayoutError(f"tokens must be integers, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) > _UINT32_MAX:
        raise LayoutError("token ids must lie in [0, 2**32)")
    return arr.astype("<u4", copy=False)


def page_keys(parent: bytes, tokens: Sequence[int] | np.ndarray, page_size: int) -> list[bytes]:
    """Keys of the full pages of `tokens`, chained from `parent`.

    `parent` is the namespace for a sequence's first page, or the key of the
    page before `tokens[0]` to extend a chain. A trailing partial page gets no
    key: only full pages are cached.
    """
    if not isinstance(parent, bytes) or len(parent) != DIGEST_BYTES:
        raise LayoutError("parent must be a 32-byte digest")
    keys: list[bytes] = []
    key = parent
    for page in _page_bytes(tokens, page_size):
        key = hashlib.sha256(key + page).digest()
        keys.append(key)
    return keys


def _page_bytes(tokens, page_size: int) -> list[bytes]:
    """The uint32 LE bytes of each full page of `tokens`."""
    if page_size <= 0:
        raise LayoutError("page_size must be positive")
    data = tokens_as_uint32(tokens)
    full = len(data) // page_size
    raw = data[: full * page_size].tobytes()
    stride = page_size * 4
    return [raw[i * stride : (i + 1) * stride] for i in range(full)]


def sglang_chain(
    tokens: Sequence[int] | np.ndarray, page_size: int, prior: bytes = b""
) -> list[bytes]:
    """SGLang's storage digests of the full pages of `tokens` (its `get_hash_str`):
    link[i] = sha256(link[i-1] || page i as uint32 LE), link[-1] = `prior` (empty,
    or the request's namespace seed, or the link of the page before `tokens[0]`)."""
    links: list[bytes] = []
    for page in _page_bytes(tokens, page_size):
        prior = hashlib.sha256(prior + page).digest()
        links.append(prior)
    return links


def sglang_page_key(namespace: bytes, link: bytes) -> bytes:
    """The kvrelay page key of one SGLang page digest in `namespace`."""
    return hashlib.sha256(namespace + SGLANG_KEY_TAG + link).digest()


def scheme_page_keys(scheme: str, namespace: bytes, tokens, page_size: int) -> list[bytes]:
    """Keys of the full pages of `tokens` under `scheme`, rooted at `namespace`."""
    chain = PageKeyChain(scheme, namespace, page_size)
    chain.extend(tokens)
    return chain.keys


class PageKeyChain:
    """The keys of a growing sequence's full pages under one key scheme.

    `extend` appends the keys of further full pages; it keeps the scheme's
    chain value of the last page (the key itself for "kvrelay", SGLang's
    digest for "sglang", which the key does not reveal)."""

    __slots__ = ("_link", "_namespace", "_page_size", "_scheme", "keys")

    def __init__(self, scheme: str, namespace: bytes, page_size: int) -> None:
        if scheme not in KEY_SCHEMES:
            raise LayoutError(f"key_scheme must be one of {KEY_SCHEMES}, got {scheme!r}")
        self.keys: list[bytes] = []
        self._scheme, self._namespace, self._page_size = scheme, namespace, page_size
        self._link = namespace if scheme == "kvrelay" else b""

    def extend(self, tokens: Sequence[int] | np.ndarray) -> list[bytes]:
        """Keys of the full pages of `tokens`, which continue the sequence right
        after its last keyed page; a trailing partial page gets no key."""
        if self._scheme == "kvrelay":
            new = page_keys(self._link, tokens, self._page_size)
            if new:
                self._link = new[-1]
        else:
            links = sglang_chain(tokens, self._page_size, self._link)
            if links:
                self._link = links[-1]
            new = [sglang_page_key(self._namespace, link) for link in links]
        self.keys.extend(new)
        return new
