"""Eviction policies behind one interface (`EvictionPolicy`), chosen by name.

`lru` is blind to chains; `prefix-lru` (the default) and `prefix-lirs` keep
a page while a later page of its chain stays and order the rest by recency
or by reuse distance (both compiled). Belady's bound and the oracles are
the bench's (`kvrelay.bench.belady`, `kvrelay.bench.oracles`), not policies.
"""

from __future__ import annotations

from kvrelay.cache.eviction.base import EvictionPolicy
from kvrelay.cache.eviction.compiled import PrefixLIRSPolicy, PrefixLRUPolicy
from kvrelay.cache.eviction.lru import LRUPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (LRUPolicy, PrefixLRUPolicy, PrefixLIRSPolicy)
}
DEFAULT_POLICY = "prefix-lru"

__all__ = ["DEFAULT_POLICY", "POLICIES", "EvictionPolicy", "make_policy"]


def make_policy(name: str = DEFAULT_POLICY) -> EvictionPolicy:
    """A fresh policy of that name; ValueError naming the choices otherwise."""
    try:
        return POLICIES[name]()
    except KeyError:
        known = sorted(POLICIES)
        raise ValueError(f"eviction policy must be one of {known}, got {name!r}") from None
