"""LFU eviction: the least frequently accessed candidate goes first."""

from __future__ import annotations

from kvstore.policy.heap import PriorityPolicy


class LFUPolicy(PriorityPolicy):
    """Lowest access count first; ties go to the least recently accessed.

    The count starts at the ``hits`` given to ``add`` (adding is not an access)
    and each ``touch`` adds 1. ``depth`` is ignored. O(log n) amortised per
    operation. Not thread-safe: the store calls it under its lock.
    """

    name = "lfu"

    def _priority(self, hits: int, depth: int) -> int:
        return hits
