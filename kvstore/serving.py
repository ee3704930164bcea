"""Run services in the foreground until SIGTERM or SIGINT, then stop them cleanly."""

from __future__ import annotations

import signal
import threading
from typing import Callable


def serve_until_signalled(stops: list[Callable[[], None]]) -> None:
    """Block until SIGTERM/SIGINT; then call ``stops`` in order (each at most once)."""
    done = threading.Event()

    def handler(signum, frame):
        done.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not done.wait(0.5):
            pass
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        for stop in stops:
            stop()
