"""Clocks the conductor reads: the real monotonic clock, or a simulated one for replay.

The conductor never calls ``time`` itself. Every public method takes ``now``
(seconds) or falls back to its clock, so the same code runs live (inside the
master, ``MonotonicClock``) and in the discrete-event replay (``SimClock``,
advanced by the event loop).
"""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on this clock (only differences matter)."""


class MonotonicClock:
    """The real clock: ``time.monotonic()``. Thread-safe."""

    def now(self) -> float:
        return time.monotonic()


class SimClock:
    """A clock that moves only when told: ``advance_to`` / ``advance``.

    Time never goes backwards (``advance_to`` an earlier time raises
    ValueError). Thread-safe: one lock guards ``_now``.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._lock = threading.Lock()
        self._now = float(start)

    def now(self) -> float:
        with self._lock:
            return self._now

    def advance_to(self, t: float) -> None:
        with self._lock:
            if t < self._now:
                raise ValueError(f"simulated time cannot go back from {self._now} to {t}")
            self._now = float(t)

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("cannot advance by a negative duration")
        with self._lock:
            self._now += seconds
