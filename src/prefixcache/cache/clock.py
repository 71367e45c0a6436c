"""Clocks. The cache never reads time itself: it calls an injected ``() -> float`` (seconds)."""

from __future__ import annotations

import time
from collections.abc import Callable

Clock = Callable[[], float]

monotonic: Clock = time.monotonic


class FakeClock:
    """A manual clock for tests and simulation: ``clock()`` returns ``clock.now``."""

    __slots__ = ("now",)

    def __init__(self, start: float = 0.0) -> None:
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        """Move time forward by ``seconds`` (never backward) and return the new time."""
        if seconds < 0:
            raise ValueError(f"a clock only moves forward; got advance({seconds})")
        self.now += seconds
        return self.now

    def set(self, now: float) -> None:
        if now < self.now:
            raise ValueError(f"a clock only moves forward; {now} < {self.now}")
        self.now = float(now)
