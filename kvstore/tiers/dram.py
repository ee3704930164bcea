"""DRAM tier: blocks in one preallocated shared-memory arena.

Each block is an extent of the arena (offset, size) described by a small
``Extent`` record; no Python bytes object is kept per block. Readers take a
lease on an extent and copy outside the lock; a block discarded or replaced
while leased stays readable and its space returns when the last lease ends.
With a block directory, every indexed block is also published there for
same-host readers, and unpublished before its space can be freed.

Thread-safe. ``_lock`` guards the index, the allocator and lease counts; it
is taken after the store's lock, never before, and no call made under it
takes another lock.
"""

from __future__ import annotations

import threading
from typing import Iterator, NamedTuple

from kvstore_client.errors import BufferTooSmall
from kvstore_client.keys import BlockKey
from kvstore.sharded import ShardedDict
from kvstore.tiers.allocator import ExtentAllocator
from kvstore.tiers.arena import SharedArena
from kvstore.tiers.directory import BlockDirectory, default_slots


class Extent:
    """Where one block's bytes live in the arena, plus its read leases."""

    __slots__ = ("offset", "size", "checksum", "leases", "doomed")

    def __init__(self, offset: int, size: int):
        self.offset = offset
        self.size = size
        self.checksum = 0
        self.leases = 0
        self.doomed = False  # no longer indexed: free when the last lease ends


class Location(NamedTuple):
    """Where a block's bytes lie in the arena, and their XXH3-64 (``DramView.location``)."""

    offset: int
    size: int
    checksum: int


class DramTier:
    """Keyed block storage in a shared-memory arena with exact byte accounting."""

    name = "dram"

    def __init__(
        self,
        capacity: int,
        *,
        granule: int = 4096,
        prefault: bool = False,
        arena_name: str | None = None,
        directory_slots: int | None = None,
    ):
        self._alloc = ExtentAllocator(capacity, granule)
        self.arena = SharedArena.create(max(self._alloc.capacity, granule), arena_name, prefault)
        self._mem = self.arena.view
        self.directory: BlockDirectory | None = None
        if directory_slots != 0:
            slots = directory_slots or default_slots(self.arena.size)
            try:
                self.directory = BlockDirectory(self.arena.path + ".dir", self.arena.size, slots)
            except BaseException:
                self.arena.close()
                raise
        self._index: ShardedDict = ShardedDict()  # BlockKey -> Extent
        self._lock = threading.Lock()

    # -- sizes ----------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self._alloc.capacity

    @property
    def used_bytes(self) -> int:
        """Bytes held by extents, indexed or awaiting their last reader (exact)."""
        return self._alloc.allocated_bytes

    def footprint(self, size: int) -> int:
        """Arena bytes a block of ``size`` bytes takes."""
        return self._alloc.extent_size(size)

    def fragmentation(self) -> float:
        with self._lock:
            return self._alloc.fragmentation()

    def largest_free_extent(self) -> int:
        """Bytes of the largest free extent: the largest block a reserve can place now."""
        with self._lock:
            return self._alloc.largest_free_extent()

    def __len__(self) -> int:
        return len(self._index)

    # -- two-phase write ----------------------------------------------------------
    def reserve(self, size: int) -> Extent | None:
        """An unindexed extent for ``size`` bytes, or None when no free extent fits."""
        with self._lock:
            offset = self._alloc.alloc(size)
        return None if offset is None else Extent(offset, size)

    def writable(self, extent: Extent) -> memoryview:
        return self._mem[extent.offset : extent.offset + extent.size]

    def commit(self, key: BlockKey, extent: Extent, checksum: int) -> None:
        """Index a written extent under ``key``, replacing (and retiring) any older one."""
        extent.checksum = checksum
        with self._lock:
            old = self._index.get(key)
            self._index[key] = extent
            if self.directory is not None:  # before the old block is retired: its slot now points here
                self.directory.publish(key, extent.offset, extent.size, checksum)
            if old is not None:
                self._retire(old)

    def abort(self, extent: Extent) -> None:
        """Free an extent that was reserved but never committed."""
        with self._lock:
            self._alloc.free(extent.offset, extent.size)

    def put(self, key: BlockKey, value: memoryview, checksum: int) -> bool:
        """Copy ``value`` in under ``key``; False when no free extent fits."""
        extent = self.reserve(len(value))
        if extent is None:
            return False
        self.writable(extent)[:] = value
        self.commit(key, extent, checksum)
        return True

    # -- reads -----------------------------------------------------------------
    def acquire(self, key: BlockKey) -> Extent | None:
        """Lease the block's extent so it cannot be freed while read; None if absent."""
        with self._lock:
            extent = self._index.get(key)
            if extent is not None:
                extent.leases += 1
            return extent

    def view(self, extent: Extent) -> memoryview:
        """Read-only view of a leased extent; valid until its lease is released."""
        return self._mem[extent.offset : extent.offset + extent.size].toreadonly()

    def release(self, extent: Extent) -> None:
        with self._lock:
            extent.leases -= 1
            if extent.leases == 0 and extent.doomed:
                self._alloc.free(extent.offset, extent.size)

    def get_into(self, key: BlockKey, out: memoryview) -> int | None:
        """Copy the block into ``out``; its size, or None when absent."""
        extent = self.acquire(key)
        if extent is None:
            return None
        try:
            if len(out) < extent.size:
                raise BufferTooSmall(f"block is {extent.size} bytes, buffer holds {len(out)}", extent.size)
            out[: extent.size] = self._mem[extent.offset : extent.offset + extent.size]
            return extent.size
        finally:
            self.release(extent)

    def get(self, key: BlockKey) -> bytes | None:
        extent = self.acquire(key)
        if extent is None:
            return None
        try:
            return bytes(self._mem[extent.offset : extent.offset + extent.size])
        finally:
            self.release(extent)

    # -- index -------------------------------------------------------------------
    def contains(self, key: BlockKey) -> bool:
        return key in self._index

    def size_of(self, key: BlockKey) -> int | None:
        extent = self._index.get(key)
        return None if extent is None else extent.size

    def current(self, key: BlockKey) -> Extent | None:
        """The indexed extent of ``key`` (no lease taken)."""
        return self._index.get(key)

    def is_leased(self, key: BlockKey) -> bool:
        extent = self._index.get(key)
        return extent is not None and extent.leases > 0

    def discard(self, key: BlockKey) -> bool:
        """Drop the block; its space returns now, or when its last reader finishes."""
        with self._lock:
            extent = self._index.pop(key, None)
            if extent is None:
                return False
            if self.directory is not None:
                self.directory.unpublish(key)
            self._retire(extent)
            return True

    def keys(self) -> Iterator[BlockKey]:
        return iter(list(self._index))

    def close(self) -> None:
        self._index.clear()
        if self.directory is not None:
            self.directory.close()
        self.arena.close()

    def _retire(self, extent: Extent) -> None:
        """Called under _lock: free now or when the last lease ends."""
        if extent.leases:
            extent.doomed = True
        else:
            self._alloc.free(extent.offset, extent.size)


class DramView:
    """The DRAM tier as code outside the store sees it (``BlockStore.dram``): the shared
    arena and block directory that same-host clients map (and the data plane describes in
    INFO), sizes, and where a block lies; nothing that reserves, commits, leases or frees.
    Thread-safe, like the tier. ``location`` takes no lease: the block may move or go right
    after; read through ``BlockStore.lease`` or ``read`` to keep the bytes in place."""

    __slots__ = ("_tier",)

    def __init__(self, tier: DramTier):
        self._tier = tier

    @property
    def arena(self) -> SharedArena:
        return self._tier.arena

    @property
    def directory(self) -> BlockDirectory | None:
        return self._tier.directory

    @property
    def capacity_bytes(self) -> int:
        return self._tier.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self._tier.used_bytes

    def __len__(self) -> int:
        return len(self._tier)

    def footprint(self, size: int) -> int:
        return self._tier.footprint(size)

    def largest_free_extent(self) -> int:
        return self._tier.largest_free_extent()

    def contains(self, key: BlockKey) -> bool:
        return self._tier.contains(key)

    def is_leased(self, key: BlockKey) -> bool:
        """Whether the block held under ``key`` now has a reader (a lease not released)."""
        return self._tier.is_leased(key)

    def location(self, key: BlockKey) -> Location | None:
        """Where the block held under ``key`` lies in the arena now; None if not in DRAM."""
        extent = self._tier.current(key)
        return None if extent is None else Location(extent.offset, extent.size, extent.checksum)

    def get(self, key: BlockKey) -> bytes | None:
        """A copy of the block's bytes as they lie in DRAM (unverified, not counted as a hit)."""
        return self._tier.get(key)
