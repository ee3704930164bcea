"""Extent allocator for the DRAM arena: offsets only, no bytes.

Two-level segregated fit (TLSF-style): free extents sit in bins by size
class, 16 sub-classes per power of two, with a bitmap of non-empty bins.
An allocation of n granules searches from the first class whose every extent
holds n, so it is O(1) in the number of bins and never scans extents; a free
coalesces with both neighbours through start/end maps, also O(1).

Sizes are rounded up to ``granule`` bytes (4 KiB by default: page alignment
for later RDMA registration and O_DIRECT-like copies), which bounds internal
waste per block to under one granule. ``allocated_bytes`` is exact.

Not thread-safe: the owning tier serialises calls under its lock.
"""

from __future__ import annotations

_SUB_BITS = 4
_SUB = 1 << _SUB_BITS


def _bin_floor(n: int) -> int:
    """Bin holding an extent of n granules (the class n falls in)."""
    if n < _SUB:
        return n
    fl = n.bit_length() - 1
    sl = (n >> (fl - _SUB_BITS)) & (_SUB - 1)
    return (fl - _SUB_BITS + 1) * _SUB + sl


def _bin_ceil(n: int) -> int:
    """First bin all of whose extents are at least n granules."""
    b = _bin_floor(n)
    if n >= _SUB:
        fl = n.bit_length() - 1
        if n & ((1 << (fl - _SUB_BITS)) - 1):  # n is not the lower bound of its class
            b += 1
    return b


class ExtentAllocator:
    """Hands out [offset, offset + size) ranges of a fixed-size region."""

    def __init__(self, capacity: int, granule: int = 4096):
        if granule <= 0 or granule & (granule - 1):
            raise ValueError("granule must be a power of two")
        self.granule = granule
        self.total_granules = capacity // granule
        self.capacity = self.total_granules * granule
        self.allocated_bytes = 0
        self._free_by_start: dict[int, int] = {}  # start granule -> length
        self._free_by_end: dict[int, int] = {}  # end granule (exclusive) -> start
        self._bins: list[dict[int, None]] = [{} for _ in range(_bin_floor(max(self.total_granules, 1)) + 1)]
        self._bitmap = 0
        if self.total_granules:
            self._insert(0, self.total_granules)

    # -- public -------------------------------------------------------------
    def granules_for(self, size: int) -> int:
        return -(-size // self.granule)

    def alloc(self, size: int) -> int | None:
        """Offset of a new extent of at least ``size`` bytes, or None if no free extent fits."""
        n = self.granules_for(size)
        if n <= 0 or n > self.total_granules:
            return None
        start = self._take(n)
        if start is None:
            return None
        self.allocated_bytes += n * self.granule
        return start * self.granule

    def free(self, offset: int, size: int) -> None:
        """Return the extent allocated at ``offset`` for ``size`` bytes."""
        start, n = offset // self.granule, self.granules_for(size)
        self.allocated_bytes -= n * self.granule
        prev_start = self._free_by_end.get(start)
        if prev_start is not None:  # merge with the free extent before
            self._remove(prev_start, start - prev_start)
            n += start - prev_start
            start = prev_start
        next_len = self._free_by_start.get(start + n)
        if next_len is not None:  # merge with the free extent after
            self._remove(start + n, next_len)
            n += next_len
        self._insert(start, n)

    def extent_size(self, size: int) -> int:
        """Bytes actually taken by a block of ``size`` bytes."""
        return self.granules_for(size) * self.granule

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.allocated_bytes

    def largest_free_extent(self) -> int:
        """Bytes of the largest free extent (O(extents in the top bin))."""
        if not self._bitmap:
            return 0
        top = self._bins[self._bitmap.bit_length() - 1]
        return max(self._free_by_start[s] for s in top) * self.granule

    def free_extent_count(self) -> int:
        return len(self._free_by_start)

    def fragmentation(self) -> float:
        """External fragmentation: share of free bytes outside the largest free extent."""
        free = self.free_bytes
        return 0.0 if free == 0 else 1.0 - self.largest_free_extent() / free

    # -- internals ------------------------------------------------------------
    def _insert(self, start: int, n: int) -> None:
        self._free_by_start[start] = n
        self._free_by_end[start + n] = start
        b = _bin_floor(n)
        self._bins[b][start] = None
        self._bitmap |= 1 << b

    def _remove(self, start: int, n: int) -> None:
        del self._free_by_start[start]
        del self._free_by_end[start + n]
        b = _bin_floor(n)
        bucket = self._bins[b]
        del bucket[start]
        if not bucket:
            self._bitmap &= ~(1 << b)

    def _take(self, n: int) -> int | None:
        # Look at one extent of n's own class first (it may fit exactly and
        # keeps big extents whole), then at the first non-empty class whose
        # every extent fits: O(1) either way.
        for start in self._bins[_bin_floor(n)]:
            if self._free_by_start[start] >= n:
                return self._split(start, n)
            break
        first = _bin_ceil(n)
        mask = self._bitmap >> first
        if not mask:
            return None
        b = first + (mask & -mask).bit_length() - 1
        return self._split(next(iter(self._bins[b])), n)

    def _split(self, start: int, n: int) -> int:
        length = self._free_by_start[start]
        self._remove(start, length)
        if length > n:
            self._insert(start + n, length - n)
        return start
