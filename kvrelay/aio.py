"""asyncio helpers for hot paths."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any


async def gather(*aws: Awaitable[Any], return_exceptions: bool = False) -> list[Any]:
    """`asyncio.gather`, awaiting a lone awaitable in place: gather wraps each
    in a task, which costs a loop turn and a task's set-up (tens of us on a
    small VM) per call, where a call to one cache server has nothing to
    overlap. Same results and the same exceptions (a cancellation propagates,
    as gather's does)."""
    if len(aws) != 1:
        return await asyncio.gather(*aws, return_exceptions=return_exceptions)
    try:
        return [await aws[0]]
    except Exception as exc:
        if not return_exceptions:
            raise
        return [exc]
