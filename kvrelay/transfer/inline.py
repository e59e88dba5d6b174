"""How long pulls done inline may hold the event loop before one yields.

A small pull (a cma batch of a few ms, a fast-path copy of up to 64 MiB) is
done on the loop's thread: handing it to another thread costs more than the
copy. Such a pull returns without suspending, like any coroutine that had
nothing to wait for, so back-to-back pulls would never give the loop a
turn. Yielding after every one (`asyncio.sleep(0)`) bounds that, but costs
60-110 us per pull from a cold cache, a tenth of a 16 MiB pull's overhead.
So each source of inline work keeps a budget: the time its inline pulls
held the loop since it last yielded; once that passes `YIELD_AFTER_S` the
pull that crossed it yields. The loop then waits at most about
`YIELD_AFTER_S` plus one pull for this source's sake.
"""

from __future__ import annotations

import asyncio

YIELD_AFTER_S = 0.016


class InlineBudget:
    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held = 0.0

    def used_up(self, seconds: float) -> bool:
        """Counts `seconds` of inline work; True (and a new budget) once the
        budget is used up: the caller then yields. Not a coroutine, so a
        pull that need not yield creates none (about 10 us from a cold
        cache)."""
        self._held += seconds
        if self._held >= YIELD_AFTER_S:
            self._held = 0.0
            return True
        return False

    async def spent(self, seconds: float) -> None:
        """Counts `seconds` of inline work; yields once the budget is used up."""
        if self.used_up(seconds):
            await asyncio.sleep(0)
