"""The scheduler's prefix lookup, which must never stall vLLM's scheduler.

``get_num_new_matched_tokens`` runs on the scheduler thread, once per new request: a lookup
that waits on a master that hangs holds every request of the engine. So each lookup has a
budget (``lookup_timeout``, a few milliseconds): past it, the request is a miss and computes
as if there were no pool. After ``LOOKUP_FAILURES`` failures in a row the pool is not asked at
all for a while (one second, doubling up to ``MAX_BACKOFF`` while it keeps failing), logged
once when that starts and once when lookups answer again. Pure policy over a ``match``
callable, so it is tested without an engine or a master.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from kvstore_client.errors import KVStoreError

log = logging.getLogger(__name__)
LOOKUP_FAILURES = 3  # failed lookups in a row before the pool is left alone for a while
FIRST_BACKOFF = 1.0  # seconds
MAX_BACKOFF = 30.0


class PrefixLookup:
    """``lookup(keys)``: the leading blocks of ``keys`` the pool holds, None when it cannot say
    within ``budget`` seconds (or is left alone for a while). ``match(keys, timeout)`` asks the
    pool (``Client.match_prefix``'s ``longest``)."""

    def __init__(self, match: Callable[[list, float], int], budget: float, clock: Callable[[], float] = time.monotonic):
        self._match, self.budget, self._clock = match, budget, clock
        self._failures = 0
        self._backoff = FIRST_BACKOFF
        self._resume_at = 0.0
        self.skipped = 0  # lookups not sent, while backing off
        self.failed = 0  # lookups that failed or ran out of budget

    @property
    def backing_off(self) -> bool:
        return self._clock() < self._resume_at

    def __call__(self, keys: list) -> int | None:
        if not keys:
            return 0
        if self._resume_at and self._clock() < self._resume_at:
            self.skipped += 1
            return None
        try:
            found = self._match(keys, self.budget)
        except (KVStoreError, OSError) as exc:
            self._failed(exc)
            return None
        if self._failures >= LOOKUP_FAILURES:
            log.warning("kvstore: prefix lookups answer again: using the pool")
        self._failures, self._backoff, self._resume_at = 0, FIRST_BACKOFF, 0.0
        return found

    def _failed(self, exc: Exception) -> None:
        self.failed += 1
        self._failures += 1
        if self._failures < LOOKUP_FAILURES:
            return
        if self._failures == LOOKUP_FAILURES:
            log.warning(
                "kvstore: %d prefix lookups in a row failed or took over %.3f s (%s): computing without "
                "the pool, asking again in %.0f s",
                LOOKUP_FAILURES,
                self.budget,
                exc,
                self._backoff,
            )
        self._resume_at = self._clock() + self._backoff
        self._backoff = min(self._backoff * 2, MAX_BACKOFF)


def warm_up(client) -> None:
    """Connect ``client`` to its master in the background (one call, its outcome ignored), so
    that the first lookups, with their budget of milliseconds, do not pay for the connection."""
    import threading

    def connect() -> None:
        try:
            client.cluster_status()
        except (KVStoreError, OSError):
            pass

    threading.Thread(target=connect, daemon=True, name="kvstore-lookup-warm-up").start()
