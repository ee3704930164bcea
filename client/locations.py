"""Where blocks live, as the master said a moment ago.

A short-lived cache (cachetools TTLCache) in front of the master's Locate:
an engine that loads a prefix right after matching it asks the master once.
Entries are dropped when a node answers "not here", so a stale entry costs one
extra round trip, never a wrong answer (bytes are checksummed end to end).
"""

from __future__ import annotations

import threading

from cachetools import TTLCache

from kvstore_client.keys import BlockKey

Replica = tuple[str, int]  # (node_id, tier as the protobuf enum value)
MAX_KEYS = 1_000_000  # keys whose locations are cached at most (past that the least recently used go)


class LocationCache:
    """Thread-safe TTL cache of key -> replicas: at most ``maxsize`` keys, each for ``ttl``
    seconds (0: nothing is cached)."""

    def __init__(self, ttl: float, maxsize: int = MAX_KEYS):
        self._cache: TTLCache = TTLCache(maxsize=maxsize, ttl=ttl)
        self._lock = threading.Lock()
        self.enabled = ttl > 0

    def lookup(self, keys: list[BlockKey]) -> list[tuple[Replica, ...] | None]:
        if not self.enabled:
            return [None] * len(keys)
        with self._lock:
            get = self._cache.get
            return [get(key) for key in keys]

    def remember(self, pairs) -> None:
        if self.enabled:
            with self._lock:
                for key, replicas in pairs:
                    self._cache[key] = replicas

    def forget(self, keys) -> None:
        with self._lock:
            for key in keys:
                self._cache.pop(key, None)
