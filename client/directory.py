"""The block directory: where a node's DRAM blocks lie in its arena, readable without asking the node.

A node publishes, for each block in its shared-memory DRAM arena, the key's
tag, the block's offset, size and checksum in a second shared-memory file
(INFO's ``directory``). A client on the same host that finds its key there
copies the block straight out of the arena without a round trip to the node
(a one-sided read, like an RDMA READ) and validates the copy afterwards, as a
seqlock reader does: the node makes a slot's sequence number odd while it
changes the slot and moves it on before the block's space can be freed, so
the same even sequence before and after the copy proves that the block was
not replaced during it. With checksum verification on, the XXH3-64 of the
bytes copied must match too (``kvstore_client.checked_copy``). A read that
fails either check is retried with LEASE.

Layout (little-endian): a 64-byte header, then ``buckets * ways`` slots of 64 bytes.

    header  magic b"KVSDIR01", u32 version, u32 ways, u64 buckets,
            u64 alive_until (CLOCK_MONOTONIC ns), u64 arena_size, 24 bytes zero
    slot    u64 seq, 16-byte tag, u64 offset, u64 size, u64 checksum, 16 bytes zero

A key's tag is the XXH3-128 of its key entry (``wire.key_entry``); its
bucket is the tag's first 8 bytes, as a u64, modulo ``buckets``; a bucket's
``ways`` slots hold any of its keys, and an empty slot has size 0. A block
whose bucket is full is simply not published (clients then LEASE it).

Liveness: the node keeps moving ``alive_until`` a second or so ahead of the
host's monotonic clock; readers use the directory only before that time, so
a node that was killed stops serving one-sided reads within about a second,
and one that shut down cleanly (``alive_until`` = 0) at once.

Memory ordering: the checks rely on loads not being reordered with loads
(and stores with stores), which x86-64 guarantees; elsewhere the SDK does
not read the directory (``ONE_SIDED_READS``) and every read takes a lease.
"""

from __future__ import annotations

import mmap
import os
import platform
import struct
import time

import xxhash

from kvstore_client.buffers import receivable_bytes
from kvstore_client.checked_copy import copy_slices_verified, copy_verified
from kvstore_client.cuda import DeviceView
from kvstore_client.keys import BlockKey
from kvstore_client.slices import table_of
from kvstore_client.wire import key_entry

MAGIC = b"KVSDIR01"
VERSION = 1
HEADER = struct.Struct("<8sIIQQQ24x")  # magic, version, ways, buckets, alive_until_ns, arena_size
HEADER_SIZE = HEADER.size  # 64
ALIVE_OFFSET = 24  # where alive_until sits in the header
SLOT_SIZE = 64
SEQ = struct.Struct("<Q")
SLOT_FIELDS = struct.Struct("<16sQQQ16x")  # after seq: tag, offset, size, checksum
DEFAULT_WAYS = 8

# x86-64 keeps loads in order with loads and stores with stores: the seqlock checks hold there.
ONE_SIDED_READS = platform.machine().lower() in ("x86_64", "amd64")

_tag = xxhash.xxh3_128_digest
_monotonic_ns = time.monotonic_ns


def key_tag(key: BlockKey) -> bytes:
    """The 16-byte tag a key is published under."""
    return _tag(key_entry(key))


def bucket_of(tag: bytes, buckets: int) -> int:
    return int.from_bytes(tag[:8], "little") % buckets


def file_size(buckets: int, ways: int) -> int:
    return HEADER_SIZE + buckets * ways * SLOT_SIZE


class DirectoryReader:
    """A client's read-only mapping of a node's block directory (see the module docstring).

    ``find(key)`` -> (slot position, seq, offset, size, checksum) or None;
    after copying, ``unchanged(position, seq)`` says whether the copy is good.
    """

    def __init__(self, path: str, arena_size: int):
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        magic, version, ways, buckets, _, published_arena = HEADER.unpack_from(self._mmap, 0)
        if magic != MAGIC or version != VERSION or ways < 1 or buckets < 1:
            self._mmap.close()
            raise ValueError(f"{path} is not a block directory this SDK reads")
        if size < file_size(buckets, ways) or published_arena != arena_size:
            self._mmap.close()
            raise ValueError(f"{path} does not describe the mapped arena")
        self.ways, self.buckets = ways, buckets
        self._bucket_bytes = ways * SLOT_SIZE
        self._tags = struct.Struct("<" + "8x16s40x" * ways).unpack_from  # the tags of one bucket

    def alive(self) -> bool:
        """Whether the node is still keeping its directory current."""
        return _monotonic_ns() < SEQ.unpack_from(self._mmap, ALIVE_OFFSET)[0]

    def find(self, key: BlockKey) -> tuple[int, int, int, int, int] | None:
        """Where ``key``'s block is: (slot position, seq, offset, size, checksum), or None."""
        mem = self._mmap
        tag = key_tag(key)
        base = HEADER_SIZE + bucket_of(tag, self.buckets) * self._bucket_bytes
        tags = self._tags(mem, base)
        if tag not in tags:
            return None
        position = base + tags.index(tag) * SLOT_SIZE
        seq = SEQ.unpack_from(mem, position)[0]  # read before the fields: see unchanged()
        if seq & 1:
            return None  # being changed right now
        found, offset, size, checksum = SLOT_FIELDS.unpack_from(mem, position + SEQ.size)
        if found != tag or not size:
            return None
        return position, seq, offset, size, checksum

    def unchanged(self, position: int, seq: int) -> bool:
        """True when the slot still has sequence ``seq``: nothing read since ``find`` was replaced."""
        return SEQ.unpack_from(self._mmap, position)[0] == seq

    def close(self) -> None:
        try:
            self._mmap.close()
        except BufferError:
            pass


class OneSidedReads:
    """Blocks read straight out of a node's mapped ``arena`` through its ``directory``, every
    copy validated: the slot unchanged, and with ``verify`` the XXH3-64 too. ``read_into``
    and ``read`` return None when that did not work (not in the directory, changed during
    the copy, too big for the buffer, the node not alive), which is not a miss: the caller
    then asks the node. Not thread-safe (one per connection)."""

    def __init__(self, directory: DirectoryReader, arena: memoryview, verify: bool):
        self.directory, self._arena, self.verify = directory, arena, verify

    def _find(self, key: BlockKey) -> tuple | None:
        directory = self.directory
        if not directory.alive():
            return None
        found = directory.find(key)
        if found is None or found[2] + found[3] > len(self._arena):
            return None
        return found

    def _copied(self, found: tuple, out: memoryview | DeviceView) -> bool:
        """Copy the block ``found`` into ``out`` (its size): whether the copy is valid."""
        copied = copy_verified(out, self._arena[found[2] : found[2] + found[3]], found[4], self.verify)
        return copied and self.directory.unchanged(found[0], found[1])

    def holds(self, key: BlockKey) -> bool:
        """Whether the directory lists ``key`` now (it may go right after: a hint, not a read)."""
        return self._find(key) is not None

    def read_into(self, key: BlockKey, view: memoryview | DeviceView) -> int | None:
        """Copy the block into ``view``: its size, or None."""
        found = self._find(key)
        if found is None or found[3] > len(view):
            return None
        size = found[3]
        return size if self._copied(found, view if size == len(view) else view[:size]) else None

    def read_range_into(self, key: BlockKey, first: int, count: int, view: memoryview | DeviceView) -> int | None:
        """Copy slices ``first .. first + count - 1`` of a sliced value into ``view``, each
        checked (``kvstore_client.slices``): their size, or None (as ``read_into``; a value
        that is not sliced, or not long enough, is None too: the node tells which)."""
        found = self._find(key)
        if found is None:
            return None
        value = self._arena[found[2] : found[2] + found[3]]
        table = table_of(value, found[4])
        if table is None or first + count > table.count:
            return None
        offset, size = table.span(first, count)
        if size > len(view):
            return None
        out = view if size == len(view) else view[:size]
        copied = copy_slices_verified(out, value, table, first, count, self.verify)
        return size if copied and self.directory.unchanged(found[0], found[1]) else None

    def read(self, key: BlockKey) -> bytes | None:
        """The block's bytes, or None."""
        found = self._find(key)
        if found is None:
            return None
        data, out = receivable_bytes(found[3])
        return data if self._copied(found, out) else None

    def close(self) -> None:
        self._arena = memoryview(b"")
        self.directory.close()


__all__ = ["DirectoryReader", "ONE_SIDED_READS", "OneSidedReads", "key_tag", "bucket_of", "file_size"]
