"""Eviction policies behind one interface (`EvictionPolicy`), chosen by name.

`lru` is blind to chains and frequency; `prefix-lirs` (the default, compiled),
`prefix-lru` and `prefix-s3fifo` keep a page while a later page of its
chain stays, and order the rest by reuse distance, recency or frequency; `belady` (the offline
bound, `kvrelay.cache.eviction.belady`) is a replay, not a policy.
"""

from __future__ import annotations

from kvrelay.cache.eviction.base import EvictionPolicy
from kvrelay.cache.eviction.compiled import PrefixLIRSPolicy
from kvrelay.cache.eviction.lru import LRUPolicy
from kvrelay.cache.eviction.prefix import PrefixLRUPolicy, PrefixS3FIFOPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (LRUPolicy, PrefixLIRSPolicy, PrefixLRUPolicy, PrefixS3FIFOPolicy)
}
DEFAULT_POLICY = "prefix-lirs"

__all__ = ["DEFAULT_POLICY", "POLICIES", "EvictionPolicy", "make_policy"]


def make_policy(name: str = DEFAULT_POLICY) -> EvictionPolicy:
    """A fresh policy of that name; ValueError naming the choices otherwise."""
    try:
        return POLICIES[name]()
    except KeyError:
        known = sorted(POLICIES)
        raise ValueError(f"eviction policy must be one of {known}, got {name!r}") from None
