"""The eviction policy interface: a policy only orders candidates.

A policy never sees bytes, sizes or locks. The store tells it which keys are
candidates (``add``), when one is used (``touch``), when one stops being a
candidate (``discard``: removed, pinned, moved to another tier), and asks it
for the next victim (``pop_victim``). Pinned blocks are simply not candidates;
a popped block that turns out to be under a read lease is re-added by the
store with its statistics (``hits``) intact. Nor are the blocks of a request
being served (Mooncake, 3.2.1): ``BlockStore.request()`` pins what a request
reads or writes until it ends, so no policy can pick a request's own fresh
blocks (LFU's lowest count) to make room for that same request.

Implementations are not thread-safe; the store calls them under its lock.
Every operation is O(1) or O(log n) in the number of candidates.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Hashable


class EvictionPolicy(ABC):
    """Orders eviction candidates of one tier."""

    name: str = ""

    @abstractmethod
    def add(self, key: Hashable, *, depth: int = 0, hits: int = 0) -> None:
        """Make ``key`` a candidate. ``depth`` is its position in its prefix chain
        (0 = first block); ``hits`` its access count so far (kept across tiers).
        Adding a key that is already a candidate refreshes it like ``touch``."""

    @abstractmethod
    def touch(self, key: Hashable) -> None:
        """Record one access of a candidate; unknown keys are ignored."""

    @abstractmethod
    def discard(self, key: Hashable) -> None:
        """Stop considering ``key``; unknown keys are ignored."""

    @abstractmethod
    def pop_victim(self) -> Hashable | None:
        """Remove and return the candidate to evict first, or None when there is none."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of candidates."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is a candidate."""
