"""Shared mechanism of priority-ordered policies: a lazily invalidated binary heap.

Each candidate has one live heap entry ``(priority, tick, key, hits, depth)``.
``tick`` is a counter bumped on every add/touch, so it is unique: heap order
never falls through to comparing keys, and it breaks priority ties by least
recent access. A touch pushes a new entry instead of updating the old one in
place; the old entry goes stale and is skipped when it reaches the top. When
stale entries outnumber live ones by more than ``STALE_FACTOR`` (plus a small
slack), the heap is rebuilt from the live entries, so memory stays below about
``(STALE_FACTOR + 1)`` entries per candidate and every operation is amortised
O(log n).
"""

from __future__ import annotations

from abc import abstractmethod
from heapq import heapify, heappop, heappush
from typing import Any, Hashable

from kvstore.policy.base import EvictionPolicy
from kvstore.sharded import ShardedDict


class PriorityPolicy(EvictionPolicy):
    """Evicts the candidate with the smallest ``(_priority(hits, depth), tick)``.

    Guards ``_live`` (key -> its current heap entry) and ``_heap`` (live and
    stale entries). An entry is live iff ``_live[key] is entry``. ``touch``
    adds 1 to ``hits``; ``add`` of a new key starts from the ``hits`` it is given
    (adding is not an access); ``add`` of an existing key is a ``touch``.
    Not thread-safe: the store calls it under its lock.
    """

    STALE_FACTOR = 2  # compact when stale entries exceed this many per live one
    COMPACT_SLACK = 64  # ... plus this many, so tiny heaps do not rebuild constantly

    def __init__(self) -> None:
        self._heap: list[tuple] = []
        self._live: ShardedDict = ShardedDict()  # key -> its current heap entry
        self._tick = 0

    @abstractmethod
    def _priority(self, hits: int, depth: int) -> Any:
        """The eviction rank of a candidate, smaller goes first. Prefer an int:
        it is compared on every heap step and, unlike a tuple, not tracked by the GC."""

    @property
    def heap_size(self) -> int:
        """Heap entries, live and stale: what the policy's memory grows with."""
        return len(self._heap)

    def add(self, key: Hashable, *, depth: int = 0, hits: int = 0) -> None:
        """Make ``key`` a candidate with ``hits`` accesses so far; an existing key is touched."""
        if key in self._live:
            self.touch(key)
        else:
            self._push(key, hits, depth)

    def touch(self, key: Hashable) -> None:
        """Count one access of a candidate; unknown keys are ignored."""
        entry = self._live.get(key)
        if entry is not None:
            self._push(key, entry[3] + 1, entry[4])

    def discard(self, key: Hashable) -> None:
        """Forget ``key`` if it is a candidate (its heap entry goes stale)."""
        if self._live.pop(key, None) is not None:
            self._maybe_compact()

    def pop_victim(self) -> Hashable | None:
        """Remove and return the lowest-ranked candidate, or None."""
        live, heap = self._live, self._heap
        if not live:
            heap.clear()
            return None
        while heap:
            entry = heappop(heap)
            key = entry[2]
            if live.get(key) is entry:
                del live[key]
                return key
        return None  # unreachable while _live and _heap agree

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: object) -> bool:
        return key in self._live

    def _push(self, key: Hashable, hits: int, depth: int) -> None:
        self._tick += 1
        entry = (self._priority(hits, depth), self._tick, key, hits, depth)
        self._live[key] = entry
        heappush(self._heap, entry)
        self._maybe_compact()

    def _maybe_compact(self) -> None:
        """Rebuild the heap from live entries once stale ones dominate."""
        live = len(self._live)
        if len(self._heap) - live > self.STALE_FACTOR * live + self.COMPACT_SLACK:
            self._heap = list(self._live.values())
            heapify(self._heap)
