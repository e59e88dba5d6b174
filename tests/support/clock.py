"""A monotonic clock that moves only when a test moves it."""

from types import SimpleNamespace


class FakeClock:
    """Stands in for `time.monotonic` in a module under test, so that back-off
    and deadline logic is checked without sleeping and without asserting
    wall-clock windows (which a busy machine breaks)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def install(self, monkeypatch, module) -> None:
        """`module.time.monotonic` reads this clock (only in that module)."""
        monkeypatch.setattr(module, "time", SimpleNamespace(monotonic=self.monotonic))
