"""Node arenas mapped once per process, shared by every shared-memory connection in it.

A client opens one connection per thread; they all share one mapping of a
node's arena. The first mapping fills its page tables at once (MAP_POPULATE)
when the arena is at most ``POPULATE_MAX_BYTES``: the first touch of each
page of a shared mapping otherwise costs a page fault in every process, about
0.3 ms per MiB of 4 KiB pages on this kind of host, and that would land on the
first reads and writes of every block. Larger arenas fault in as they are
used (populating 64 GiB of 4 KiB pages takes seconds and 128 MiB of page
tables); arenas on huge pages fault 512 times less either way. Mappings are 2 MiB-aligned
(``kvstore_client.sharedmap``), so an arena on huge pages is mapped with them.

``mapping_at(address)`` finds the mapping an address lies in, and ``on_unmap`` runs a
callback just before a mapping goes: ``kvstore_client.cuda`` registers a mapping as
pinned memory for GPU copies the first time one touches it, and unregisters it there.
"""

from __future__ import annotations

import ctypes
import os
import threading

from kvstore_client.sharedmap import map_shared

POPULATE_MAX_BYTES = 8 << 30

_lock = threading.Lock()
# (st_dev, st_ino) -> [mmap, its view, connections using it, its address, callbacks before unmapping]
_mappings: dict[tuple[int, int], list] = {}


def map_arena(path: str) -> tuple[tuple[int, int], memoryview]:
    """(handle, writable view of the whole arena at ``path``); ``unmap_arena(handle)`` when done."""
    fd = os.open(path, os.O_RDWR)
    try:
        stat = os.fstat(fd)
        handle = (stat.st_dev, stat.st_ino)
        with _lock:
            entry = _mappings.get(handle)
            if entry is None:
                owner, view = map_shared(fd, stat.st_size, populate=stat.st_size <= POPULATE_MAX_BYTES)
                entry = _mappings[handle] = [owner, view, 0, _address(view), []]
            entry[2] += 1
            return handle, entry[1][:]  # a view of its own: the connection releases it when it closes
    finally:
        os.close(fd)


def _address(view: memoryview) -> int:
    """Where a (writable) view's first byte lies; 0 for an empty one."""
    if not len(view):
        return 0
    anchor = ctypes.c_char.from_buffer(view)
    address = ctypes.addressof(anchor)
    del anchor
    return address


def mapping_at(address: int) -> tuple[tuple[int, int], memoryview] | None:
    """(handle, view of the whole mapping) of the arena mapping that holds ``address``, or None."""
    with _lock:
        for handle, entry in _mappings.items():
            if entry[3] <= address < entry[3] + len(entry[1]):
                return handle, entry[1]
    return None


def on_unmap(handle: tuple[int, int], callback) -> bool:
    """Run ``callback()`` just before the mapping ``handle`` is unmapped; False when it is gone."""
    with _lock:
        entry = _mappings.get(handle)
        if entry is None:
            return False
        entry[4].append(callback)
        return True


def unmap_arena(handle: tuple[int, int]) -> None:
    """One user fewer; the last one unmaps (or, if views of it are still alive, the GC does),
    after the ``on_unmap`` callbacks."""
    with _lock:
        entry = _mappings.get(handle)
        if entry is None:
            return
        entry[2] -= 1
        if entry[2]:
            return
        del _mappings[handle]
    for callback in entry[4]:
        callback()
    try:
        entry[1].release()
        entry[0].close()
    except BufferError:  # a caller still holds a view of it
        pass
