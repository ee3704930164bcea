"""Run services in the foreground until SIGTERM or SIGINT, then stop them cleanly; SIGHUP
runs what ``StopSignals.on_hangup`` was given (the services reload their access file).

``service_process()`` readies a process to serve: stop signals caught, and the
garbage collector kept from pausing it for all of its state (``kvstore.gc_pauses``)."""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from typing import Callable

POLL_S = 0.1


class StopSignals:
    """SIGTERM and SIGINT, caught from construction on: create it before starting services,
    so that a signal that arrives while they start or announce themselves still stops them
    cleanly (instead of killing the process with arenas and sockets left behind).

    The handler only sets a flag: a handler runs in the main thread between two bytecodes,
    so one that took a lock (``Event.set`` does) would deadlock whenever the signal landed
    while the main thread held that lock. ``wait`` sleeps in ``select`` on a pipe that the
    interpreter writes a byte to as any signal arrives (``signal.set_wakeup_fd``), so an idle
    service process has no thread waking up to look at the flag. Handlers are installed
    only in the main thread (elsewhere ``wait`` polls the flag until the process ends)."""

    def __init__(self) -> None:
        self._stopping = False
        self._hangups = 0  # SIGHUPs received; handled by ``wait`` in the main thread
        self._on_hangup: list[Callable[[], object]] = []
        self._previous = {}
        self._wakeup: tuple[int, int] | None = None  # the pipe (read end, write end) signals wake wait on
        self._previous_wakeup_fd = -1
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handler) for sig in (signal.SIGTERM, signal.SIGINT)}
            self._previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, self._hangup)
            read_end, write_end = os.pipe()
            for fd in (read_end, write_end):
                os.set_blocking(fd, False)
            self._wakeup = (read_end, write_end)
            self._previous_wakeup_fd = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)

    def _handler(self, signum, frame) -> None:
        self._stopping = True

    def _hangup(self, signum, frame) -> None:
        self._hangups += 1

    def on_hangup(self, callback: Callable[[], object]) -> None:
        """Run ``callback()`` in the main thread, from ``wait``, after each SIGHUP."""
        self._on_hangup.append(callback)

    @property
    def stopping(self) -> bool:
        """Whether a stop signal came (for a start that waits, to give up on)."""
        return self._stopping

    def wait(self) -> None:
        """Block until a stop signal came (at once if one came already), running the hangup
        callbacks after each SIGHUP meanwhile."""
        handled = 0
        while not self._stopping:
            if self._hangups != handled:
                handled = self._hangups
                for callback in self._on_hangup:
                    callback()
                continue
            if self._wakeup is None:
                time.sleep(POLL_S)
                continue
            select.select([self._wakeup[0]], [], [])  # a signal's byte lands here, before the flag is checked again
            try:
                os.read(self._wakeup[0], 512)
            except BlockingIOError:
                pass

    def restore(self) -> None:
        """Put back the handlers there were before."""
        for sig, old in self._previous.items():
            signal.signal(sig, old)
        self._previous = {}
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._previous_wakeup_fd)
            for fd in self._wakeup:
                os.close(fd)
            self._wakeup = None

    def serve(self, stops: list[Callable[[], None]]) -> None:
        """``wait``; then restore the handlers and call ``stops`` in order."""
        try:
            self.wait()
        finally:
            self.restore()
            for stop in stops:
                stop()


def service_process(switch_interval: float | None = None) -> StopSignals:
    """Ready this process to run services (call before starting them): its StopSignals.
    ``switch_interval``: seconds a thread may keep the GIL while another waits for it
    (``sys.setswitchinterval``; None: Python's default)."""
    import sys

    from kvstore import gc_pauses

    if switch_interval is not None:
        sys.setswitchinterval(switch_interval)
    signals = StopSignals()
    gc_pauses.install()
    return signals
