"""Stop strings: cut a streamed answer's text before the first stop string.

Text arrives in pieces (one per decode batch), and a stop string can span
pieces, so the tail that could still become a stop string is held back
until the next piece decides it; the stop string itself is never emitted.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""  # text that may be the start of a stop string
        self.stopped = False

    def feed(self, text: str) -> str:
        """The text that is safe to emit now; sets `stopped` when a stop
        string appeared (the text before it is returned, nothing after)."""
        if self.stopped:
            return ""
        buffer = self._held + text
        cut = min((i for i in (buffer.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self._held = True, ""
            return buffer[:cut]
        keep = self._partial_tail(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """The answer ended without a stop: the held-back tail is plain text."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_tail(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that begins some stop string."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if stop.startswith(buffer[-size:]):
                    longest = size
                    break
        return longest
