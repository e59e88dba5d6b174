"""The cache tier (DESIGN.md section 5): page index, key ring, L3 stores."""

from kvrelay.cache.index import (
    CacheIndexError,
    L2Slot,
    L3Object,
    Lease,
    LookupResult,
    PageEntry,
    PageIndex,
)

__all__ = [
    "CacheIndexError",
    "L2Slot",
    "L3Object",
    "Lease",
    "LookupResult",
    "PageEntry",
    "PageIndex",
]
