"""Maps split into shards, so that no one dict holds every block of a store.

A CPython dict that keeps losing and gaining keys rebuilds its hash table in
one go every few hundred thousand changes (and when it grows): at 500,000
entries that takes 30 ms for a dict and 50 ms for an OrderedDict, and a node
does it with its store lock held, once per map, all on the same put. Split
into ``SHARDS`` dicts by the key's hash, each rebuild handles 1/16 of the
entries. The shard comes from high bits of the hash: the dicts inside probe
with the low ones, which must stay spread.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import count
from typing import Hashable, Iterator

SHARDS = 16  # a power of two
_SHIFT = 48  # the shard is hash bits 48-51
_EMPTY = 1 << 63  # the head stamp of an empty shard: after every real one


class ShardedDict:
    """The dict operations the store's maps use, over ``SHARDS`` dicts. Iteration visits
    shard after shard (no global insertion order)."""

    __slots__ = ("_shards", "_len")

    def __init__(self, items=()) -> None:
        self._shards: list[dict] = [{} for _ in range(SHARDS)]
        self._len = 0  # kept, not summed: policies ask on every change
        for key, value in items:
            self[key] = value

    def __getitem__(self, key: Hashable):
        return self._shards[(hash(key) >> _SHIFT) & (SHARDS - 1)][key]

    def __setitem__(self, key: Hashable, value) -> None:
        shard = self._shards[(hash(key) >> _SHIFT) & (SHARDS - 1)]
        before = len(shard)
        shard[key] = value
        self._len += len(shard) - before

    def __delitem__(self, key: Hashable) -> None:
        del self._shards[(hash(key) >> _SHIFT) & (SHARDS - 1)][key]
        self._len -= 1

    def __contains__(self, key: object) -> bool:
        return key in self._shards[(hash(key) >> _SHIFT) & (SHARDS - 1)]

    def get(self, key: Hashable, default=None):
        return self._shards[(hash(key) >> _SHIFT) & (SHARDS - 1)].get(key, default)

    def pop(self, key: Hashable, *default):
        shard = self._shards[(hash(key) >> _SHIFT) & (SHARDS - 1)]
        before = len(shard)
        value = shard.pop(key, *default)
        self._len -= before - len(shard)
        return value

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator:
        for shard in self._shards:
            yield from shard

    def keys(self) -> Iterator:
        return iter(self)

    def values(self) -> Iterator:
        for shard in self._shards:
            yield from shard.values()

    def items(self) -> Iterator:
        for shard in self._shards:
            yield from shard.items()

    def clear(self) -> None:
        for shard in self._shards:
            shard.clear()
        self._len = 0


class ShardedRecency:
    """Keys in least-recently-used order, over ``SHARDS`` OrderedDicts: each shard is in
    recency order and stamps its keys with a global counter, and ``_heads`` keeps the stamp
    of each shard's least recent key, so the least recent key of all is the shard with the
    smallest head (exact LRU)."""

    __slots__ = ("_shards", "_heads", "_clock")

    def __init__(self) -> None:
        self._shards: list[OrderedDict] = [OrderedDict() for _ in range(SHARDS)]
        self._heads: list[int] = [_EMPTY] * SHARDS
        self._clock = count()

    def touch(self, key: Hashable, add: bool) -> None:
        """Make ``key`` the most recent; a key not held is added only when ``add``."""
        index = (hash(key) >> _SHIFT) & (SHARDS - 1)
        shard = self._shards[index]
        stamp = shard.get(key)
        if stamp is not None:
            shard.move_to_end(key)
        elif not add:
            return
        shard[key] = tick = next(self._clock)
        if stamp == self._heads[index] or len(shard) == 1:  # the head moved to the back, or is new
            self._heads[index] = next(iter(shard.values())) if stamp is not None else tick

    def discard(self, key: Hashable) -> None:
        index = (hash(key) >> _SHIFT) & (SHARDS - 1)
        if self._shards[index].pop(key, None) == self._heads[index]:
            self._new_head(index)

    def pop_oldest(self) -> Hashable | None:
        """Remove and return the least recently used key, or None when empty."""
        oldest = min(self._heads)
        if oldest == _EMPTY:
            return None
        index = self._heads.index(oldest)
        key = self._shards[index].popitem(last=False)[0]
        self._new_head(index)
        return key

    def _new_head(self, index: int) -> None:
        shard = self._shards[index]
        self._heads[index] = next(iter(shard.values())) if shard else _EMPTY

    def __len__(self) -> int:
        return sum(map(len, self._shards))

    def __contains__(self, key: object) -> bool:
        return key in self._shards[(hash(key) >> _SHIFT) & (SHARDS - 1)]
