"""Which addresses this node may PULL from: the data addresses of live registered nodes.

A PULL names its source as a "host:port" the node then dials, so without a
check any client could make a node connect anywhere (a port scanner, or a
relay into a network the client cannot reach). The master's membership is the
list of nodes that may be sources; it is fetched on demand and kept briefly,
so a replication burst costs one ClusterStatus call, not one per PULL. When
the master cannot say, only addresses seen live within ``max_age_s`` pass.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable

log = logging.getLogger(__name__)


class RegisteredPeers:
    """``allows(address)``: whether ``address`` is a live registered node's data address.

    ``fetch`` returns the current set (MasterAgent.live_data_addresses). An address not in a
    fresh set is looked up again at most every ``min_refresh_s``. Thread-safe.
    """

    def __init__(
        self,
        fetch: Callable[[], Iterable[str]],
        max_age_s: float = 2.0,
        min_refresh_s: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._fetch = fetch
        self._max_age_s = max_age_s
        self._min_refresh_s = min_refresh_s
        self._clock = clock
        self._lock = threading.Lock()
        self._addresses: frozenset[str] = frozenset()
        self._fetched_at = float("-inf")

    def allows(self, address: str) -> bool:
        with self._lock:
            age = self._clock() - self._fetched_at
            addresses = self._addresses
        if address in addresses and age < self._max_age_s:
            return True
        if age >= self._min_refresh_s:
            addresses = self._refresh()
        return address in addresses

    def _refresh(self) -> frozenset[str]:
        try:
            fresh = frozenset(self._fetch())
        except Exception as exc:  # the master is down or slow: nothing new to go by
            log.warning("cannot list registered nodes for a PULL source check: %s", exc)
            with self._lock:
                stale = self._clock() - self._fetched_at >= self._max_age_s
                return frozenset() if stale else self._addresses
        with self._lock:
            self._addresses, self._fetched_at = fresh, self._clock()
        return fresh
