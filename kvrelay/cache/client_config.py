"""A `CacheClient`'s settings and counters."""

from __future__ import annotations

from dataclasses import dataclass

from kvrelay.cache.policy import WritePolicy
from kvrelay.rpc.cache_ops import DEFAULT_LEASE_S


@dataclass(frozen=True, slots=True)
class CacheClientConfig:
    servers: tuple[str, ...]  # "host:port" control addresses
    token: str
    timeout_s: float = 2.0
    lease_s: float = DEFAULT_LEASE_S
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    # Write-back: pages the client can hold (its staging arena holds this many
    # rectangles; pages offered beyond it are dropped, not waited for) ...
    write_back_pages: int = 64
    # ... pushed as soon as this many wait, or this long after one was queued.
    write_back_batch: int = 16
    write_back_delay_s: float = 0.05
    # Ask a server for the ring control published this often (0: keep `servers`).
    ring_poll_s: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "write_policy", WritePolicy.of(self.write_policy, "write_policy"))
        if not 0 < self.write_back_batch <= self.write_back_pages:
            raise ValueError("need 0 < write_back_batch <= write_back_pages")
        if self.write_back_delay_s < 0 or self.timeout_s <= 0 or self.ring_poll_s < 0:
            raise ValueError("need write_back_delay_s >= 0, timeout_s > 0, ring_poll_s >= 0")


@dataclass(slots=True)
class ClientStats:
    lookups: int = 0
    lookup_pages: int = 0
    hit_pages: int = 0  # from the servers and from the write-back queue
    queue_hit_pages: int = 0  # of those, answered from the write-back queue
    written_pages: int = 0  # went into a server (pages already sealed there do not count)
    queued_pages: int = 0  # write-back: accepted into the queue
    pending_pages: int = 0  # write-back: waiting now
    dropped_pages: int = 0  # write-back: queue full, or the push failed
    bytes_in: int = 0  # pulled from the tier
    bytes_out: int = 0  # pushed to the tier
    errors: int = 0  # server calls that failed and were answered as misses
