"""The writer side of the block directory (format and read protocol: ``kvstore_client.directory``).

The DRAM tier publishes each block it indexes and unpublishes it before its
space can be freed, under the tier's lock; the data-plane server calls
``beat`` a few times a second so same-host readers keep trusting it. A block
whose bucket is full stays unpublished (readers lease it instead): the
directory is a fast path, never the source of truth.
"""

from __future__ import annotations

import mmap
import os
import time
import weakref

from kvstore_client.directory import (
    ALIVE_OFFSET,
    DEFAULT_WAYS,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    SEQ,
    SLOT_FIELDS,
    SLOT_SIZE,
    VERSION,
    bucket_of,
    file_size,
    key_tag,
)
from kvstore_client.keys import BlockKey
from kvstore.sharded import ShardedDict
from kvstore.tiers.arena import unlink_quietly

_EMPTY = SLOT_FIELDS.pack(bytes(16), 0, 0, 0)
BLOCK_BYTES_PER_SLOT = 32 << 10  # auto sizing: one slot per 32 KiB of arena (at least 4,096 slots)


def default_slots(arena_bytes: int) -> int:
    return max(4096, arena_bytes // BLOCK_BYTES_PER_SLOT)


class BlockDirectory:
    """Publishes (key tag -> offset, size, checksum) of DRAM blocks in a shared-memory file.

    Not thread-safe: the owner (the DRAM tier) calls publish/unpublish under
    its lock; ``beat`` touches only the header and may run on another thread.
    """

    def __init__(self, path: str, arena_size: int, slots: int, ways: int = DEFAULT_WAYS):
        self.path = path
        self.name = os.path.basename(path)
        self.ways = ways
        self.buckets = max(1, -(-slots // ways))
        size = file_size(self.buckets, ways)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)  # sparse: pages appear as slots are written
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        HEADER.pack_into(self._mmap, 0, MAGIC, VERSION, ways, self.buckets, 0, arena_size)
        self._slot_of: ShardedDict = ShardedDict()  # BlockKey -> slot
        self._taken = bytearray(self.buckets * ways)  # 1 where a slot holds a block
        self.unpublished = 0  # blocks left out because their bucket was full
        self._unlink_at_exit = weakref.finalize(self, unlink_quietly, path)

    def __len__(self) -> int:
        return len(self._slot_of)

    def publish(self, key: BlockKey, offset: int, size: int, checksum: int) -> bool:
        """Point ``key``'s slot at a block (claiming a slot if it has none); False if its bucket is full."""
        slot = self._slot_of.get(key)
        tag = key_tag(key)
        if slot is None:
            first = bucket_of(tag, self.buckets) * self.ways
            slot = self._taken.find(0, first, first + self.ways)
            if slot < 0:
                self.unpublished += 1
                return False
            self._taken[slot] = 1
            self._slot_of[key] = slot
        self._write(slot, SLOT_FIELDS.pack(tag, offset, size, checksum))
        return True

    def unpublish(self, key: BlockKey) -> None:
        """Empty ``key``'s slot; call before the block's space may be reused."""
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self._write(slot, _EMPTY)
            self._taken[slot] = 0

    def _write(self, slot: int, fields: bytes) -> None:
        """Seqlock write: odd sequence, the fields, then the next even sequence."""
        mem, position = self._mmap, HEADER_SIZE + slot * SLOT_SIZE
        seq = SEQ.unpack_from(mem, position)[0]
        SEQ.pack_into(mem, position, seq + 1)
        mem[position + SEQ.size : position + SLOT_SIZE] = fields
        SEQ.pack_into(mem, position, seq + 2)

    def beat(self, lifetime_s: float) -> None:
        """Tell readers the directory is current for the next ``lifetime_s`` seconds."""
        mem = self._mmap
        try:
            if mem is not None:
                SEQ.pack_into(mem, ALIVE_OFFSET, time.monotonic_ns() + int(lifetime_s * 1e9))
        except ValueError:  # closed meanwhile
            pass

    def close(self) -> None:
        """Stop readers at once, unmap and remove the file."""
        if self._mmap is None:
            return
        SEQ.pack_into(self._mmap, ALIVE_OFFSET, 0)
        self._mmap.close()
        self._mmap = None
        self._unlink_at_exit()
