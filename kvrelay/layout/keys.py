"""Page keys: a sha256 chain over full pages of tokens, rooted at a namespace.

    key[-1] = namespace
    key[i]  = sha256(key[i-1] || tokens of page i as uint32 little-endian)

A key names content (model identity + every token before and in the page), never
a writer, so the same prefix has the same keys under any parallel config.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from kvrelay.layout.spec import DIGEST_BYTES, LayoutError

_UINT32_MAX = 2**32 - 1


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
    if page_size <= 0:
        raise LayoutError("page_size must be positive")
    data = tokens_as_uint32(tokens)
    full = len(data) // page_size
    raw = data[: full * page_size].tobytes()
    stride = page_size * 4
    keys: list[bytes] = []
    key = parent
    for i in range(full):
        key = hashlib.sha256(key + raw[i * stride : (i + 1) * stride]).digest()
        keys.append(key)
    return keys
