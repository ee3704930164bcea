"""Node arenas mapped once per process, shared by every shared-memory connection in it.

A client opens one connection per thread; they all share one mapping of a
node's arena. The first mapping fills its page tables at once (MAP_POPULATE)
when the arena is at most ``POPULATE_MAX_BYTES``: the first touch of each
page of a shared mapping otherwise costs a page fault in every process, about
0.3 ms per MiB of 4 KiB pages on this kind of host, and that would land on the
first reads and writes of every block. Larger arenas fault in as they are
used (populating 64 GiB of 4 KiB pages takes seconds and 128 MiB of page
tables); arenas on huge pages fault 512 times less either way.
"""

from __future__ import annotations

import mmap
import os
import threading

POPULATE_MAX_BYTES = 8 << 30

_lock = threading.Lock()
_mappings: dict[tuple[int, int], list] = {}  # (st_dev, st_ino) -> [mmap, connections using it]


def map_arena(path: str) -> tuple[tuple[int, int], memoryview]:
    """(handle, writable view of the whole arena at ``path``); ``unmap_arena(handle)`` when done."""
    fd = os.open(path, os.O_RDWR)
    try:
        stat = os.fstat(fd)
        handle = (stat.st_dev, stat.st_ino)
        with _lock:
            entry = _mappings.get(handle)
            if entry is None:
                populate = getattr(mmap, "MAP_POPULATE", 0) if stat.st_size <= POPULATE_MAX_BYTES else 0
                entry = _mappings[handle] = [mmap.mmap(fd, stat.st_size, flags=mmap.MAP_SHARED | populate), 0]
            entry[1] += 1
            return handle, memoryview(entry[0])
    finally:
        os.close(fd)


def unmap_arena(handle: tuple[int, int]) -> None:
    """One user fewer; the last one unmaps (or, if views of it are still alive, the GC does)."""
    with _lock:
        entry = _mappings.get(handle)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1]:
            return
        del _mappings[handle]
    try:
        entry[0].close()
    except BufferError:  # a caller still holds a view of it
        pass
