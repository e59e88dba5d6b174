"""`prefix-lirs`, compiled: the policy the index runs by default.

`kvrelay.cache.eviction._lirs` (C++, plain CPython) makes the same choices
as the reference, `PrefixLIRSReference` in `kvrelay.cache.eviction.lirs`,
step for step: tests compare both states after every call. The reference
pays a Python call and a dict operation or two per step of LIRS's
bookkeeping, which made the index twice as slow per page read as under
LRU; compiled, a read is one dict lookup and some pointer work, and the
index costs what it does under LRU (`kvrelay bench cache`, index cost).

Without the compiled module (a source tree not built) `prefix-lirs` is the
reference, with the same choices at its own speed.
"""

from __future__ import annotations

from kvrelay.cache.eviction.base import EvictionPolicy
from kvrelay.cache.eviction.lirs import PrefixLIRSReference

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
