"""The cache tier (DESIGN.md section 5): page index, L3 stores, L2 arena,
tier, server and client (import those from their modules)."""

from kvrelay.cache.index import (
    CacheIndexError,
    LookupResult,
    PageEntry,
    PageIndex,
    PinLease,
)

__all__ = [
    "CacheIndexError",
    "LookupResult",
    "PageEntry",
    "PageIndex",
    "PinLease",
]
