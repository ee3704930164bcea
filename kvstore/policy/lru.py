"""LRU eviction: the least recently used candidate goes first."""

from __future__ import annotations

from typing import Hashable

from kvstore.policy.base import EvictionPolicy
from kvstore.sharded import ShardedRecency


class LRUPolicy(EvictionPolicy):
    """Least recently used first, kept in OrderedDicts in recency order (sharded, so that
    no rebuild of one holds every block: ``kvstore.sharded``).

    Every operation is O(1) (a pop looks at one head per shard). ``depth`` and ``hits``
    are ignored: only recency counts. Not thread-safe: the store calls it under its lock.
    """

    name = "lru"

    def __init__(self) -> None:
        self._order = ShardedRecency()

    def add(self, key: Hashable, *, depth: int = 0, hits: int = 0) -> None:
        """Make ``key`` the most recent candidate (an existing key is touched)."""
        self._order.touch(key, add=True)

    def touch(self, key: Hashable) -> None:
        """Move a candidate to the most recent end; unknown keys are ignored."""
        self._order.touch(key, add=False)

    def discard(self, key: Hashable) -> None:
        """Forget ``key`` if it is a candidate."""
        self._order.discard(key)

    def pop_victim(self) -> Hashable | None:
        """Remove and return the least recently used candidate, or None."""
        return self._order.pop_oldest()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
