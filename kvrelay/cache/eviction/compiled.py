"""The compiled policies: `prefix-lru` (the default) and `prefix-lirs`.

`kvrelay.cache.eviction._prefix_lru` and `._lirs` (C++, plain CPython) make
the same choices as their references, `PrefixLRUReference` in `prefix.py`
and `PrefixLIRSReference` in `lirs.py`, step for step: tests compare both
states after every call. A reference pays a Python call and a dict
operation or two per step, and an object per page admitted, which made the
index's insert 1.6x (prefix-lru) and its lookup up to 5x (prefix-lirs) as
slow as under LRU; compiled, a read is one dict lookup and some pointer
work, and the index costs what it does under LRU (`kvrelay bench cache
--cost-rounds`).

Without a compiled module (a source tree not built) the policy is its
reference, with the same choices at its own speed.
"""

from __future__ import annotations

from kvrelay.cache.eviction.base import EvictionPolicy
from kvrelay.cache.eviction.lirs import PrefixLIRSReference
from kvrelay.cache.eviction.prefix import PrefixLRUReference

try:
    from kvrelay.cache.eviction._prefix_lru import PrefixLRU as _CompiledLRU
except ImportError:  # not built: the reference stands in
    _CompiledLRU = None
try:
    from kvrelay.cache.eviction._lirs import PrefixLIRS as _Compiled
except ImportError:  # not built: the reference stands in
    _Compiled = None


if _Compiled is not None:

    class CompiledPrefixLIRSPolicy(_Compiled, EvictionPolicy):
        """Prefix-LIRS in C++; the same parameters as the reference."""

        name = "prefix-lirs"
        hir_share = PrefixLIRSReference.hir_share
        ghost_factor = PrefixLIRSReference.ghost_factor
        share_bounds = PrefixLIRSReference.share_bounds
        share_band = PrefixLIRSReference.share_band
        stale_factor = PrefixLIRSReference.stale_factor

        def __init__(self) -> None:
            low, high = self.share_bounds
            super().__init__(
                self.hir_share, self.ghost_factor, low, high, self.share_band, self.stale_factor
            )

    PrefixLIRSPolicy: type[EvictionPolicy] = CompiledPrefixLIRSPolicy
else:
    CompiledPrefixLIRSPolicy = None
    PrefixLIRSPolicy = PrefixLIRSReference


if _CompiledLRU is not None:

    class CompiledPrefixLRUPolicy(_CompiledLRU, EvictionPolicy):
        """Prefix-LRU in C++; the same parameter as the reference."""

        name = "prefix-lru"
        guess_weight = PrefixLRUReference.guess_weight

        def __init__(self) -> None:
            super().__init__(self.guess_weight)

    PrefixLRUPolicy: type[EvictionPolicy] = CompiledPrefixLRUPolicy
else:
    CompiledPrefixLRUPolicy = None
    PrefixLRUPolicy = PrefixLRUReference


def reference_state(policy: PrefixLIRSReference) -> dict:
    """The reference's state as `CompiledPrefixLIRSPolicy.debug_state` gives it."""
    return {
        "resident": dict(policy._resident),
        "children": dict(policy._children),
        "held": set(policy._held),
        "top": list(policy._top.items()),
        "tail": list(policy._tail.items()),
        "front": list(policy._front),
        "queue": list(policy._queue),
        "parked": list(policy._parked),
        "lirs": policy._lirs,
        "ghosts": policy._ghosts,
        "times": {k: (t, policy._gap.get(k), policy._gap2.get(k)) for k, t in policy._last.items()},
        "now": policy._now,
        "finished_read": policy._finished_read,
        "hir_share": policy._hir_now,
    }
