"""When pages go down a level: the one enum of the client's writes to the
tier and of the tier's writes to L3."""

from __future__ import annotations

import enum


class WritePolicy(enum.StrEnum):
    WRITE_THROUGH = "write-through"  # at once (client: in `write()`; tier: when a page seals)
    WRITE_BACK = "write-back"  # later (client: batched in the background; tier: on eviction)

    @classmethod
    def of(cls, value: str, name: str) -> WritePolicy:
        """`value` as a policy; ValueError naming the setting otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"{name} must be one of {[p.value for p in cls]}, got {value!r}"
            ) from None
