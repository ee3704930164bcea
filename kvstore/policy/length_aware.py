"""Length-aware eviction: LFU that evicts deeper prefix blocks first among equals."""

from __future__ import annotations

from kvstore.policy.heap import PriorityPolicy

_DEPTH_BITS = 32
_MAX_DEPTH = (1 << _DEPTH_BITS) - 1


class LengthAwarePolicy(PriorityPolicy):
    """Victim = the candidate with the smallest ``(hits, -depth, last access tick)``.

    - lowest access count first (counted as in ``LFUPolicy``: starts at the
      ``hits`` given to ``add``, ``touch`` adds 1);
    - among equal counts, the deepest block in its prefix chain goes first
      (``depth`` as given to ``add``, 0 = first block): a deep block is useless
      without its ancestors, and later blocks of a request are reused less;
    - remaining ties by least recent access (add or touch).

    The paper only says "like LFU but prioritising blocks that occur later in
    requests"; this is our exact reading. ``(hits, -depth)`` is stored as the
    single int ``(hits << 32) - depth`` (same order for depths in [0, 2**32),
    larger ones are clamped): a nested tuple per entry made heap comparisons
    and garbage collection several times slower at 1M candidates.
    O(log n) amortised per operation. Not thread-safe: the store calls it
    under its lock.
    """

    name = "length_aware"

    def _priority(self, hits: int, depth: int) -> int:
        if not 0 <= depth <= _MAX_DEPTH:
            depth = 0 if depth < 0 else _MAX_DEPTH
        return (hits << _DEPTH_BITS) - depth
