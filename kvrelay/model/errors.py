"""Typed errors of the model runner, so callers can tell bad input from capacity."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model directory, config or weight file that cannot be loaded.

    The message names the file and, for weights, the tensor.
    """


class PoolExhausted(RuntimeError):
    """The KV pool has too few free pages for a request.

    A scheduler can queue the request or reject it; nothing was allocated.
    """

    def __init__(self, needed: int, available: int) -> None:
        super().__init__(f"KV pool exhausted: need {needed} pages, {available} can be freed")
        self.needed = needed
        self.available = available

    def __reduce__(self):
        # Rebuilt from its fields when it crosses a process boundary (spawned ranks).
        return (type(self), (self.needed, self.available))


class PrefixNotCached(LookupError):
    """An export asked for pages that are not (all) in this worker's pool."""


class RequestError(ValueError):
    """A request the engine cannot run as given (empty prompt, bad sampling values)."""


class StagingTooSmall(RequestError):
    """A single request needs more staging rows than the worker's arena has
    (its new pages): it can never run there, whatever else is running."""
