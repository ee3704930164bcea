"""LRU eviction: the least recently used candidate goes first."""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

from kvstore.policy.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """Least recently used first, kept in an OrderedDict (front = oldest).

    Every operation is O(1). ``depth`` and ``hits`` are ignored: only recency
    counts. Not thread-safe: the store calls it under its lock.
    """

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def add(self, key: Hashable, *, depth: int = 0, hits: int = 0) -> None:
        """Make ``key`` the most recent candidate (an existing key is touched)."""
        order = self._order
        if key in order:
            order.move_to_end(key)
        else:
            order[key] = None

    def touch(self, key: Hashable) -> None:
        """Move a candidate to the most recent end; unknown keys are ignored."""
        try:
            self._order.move_to_end(key)
        except KeyError:
            pass

    def discard(self, key: Hashable) -> None:
        """Forget ``key`` if it is a candidate."""
        self._order.pop(key, None)

    def pop_victim(self) -> Hashable | None:
        """Remove and return the least recently used candidate, or None."""
        if not self._order:
            return None
        return self._order.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
