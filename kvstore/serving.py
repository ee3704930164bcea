"""Run services in the foreground until SIGTERM or SIGINT, then stop them cleanly."""

from __future__ import annotations

import signal
import threading
from typing import Callable


class StopSignals:
    """SIGTERM and SIGINT, caught from construction on: create it before starting services,
    so that a signal that arrives while they start or announce themselves still stops them
    cleanly (instead of killing the process with arenas and sockets left behind)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._previous = {sig: signal.signal(sig, self._handler) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _handler(self, signum, frame) -> None:
        self._done.set()

    def serve(self, stops: list[Callable[[], None]]) -> None:
        """Block until a signal (or one that came already); then call ``stops`` in order."""
        try:
            while not self._done.wait(0.5):
                pass
        finally:
            for sig, old in self._previous.items():
                signal.signal(sig, old)
            for stop in stops:
                stop()
