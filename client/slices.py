"""Values made of slices: one value whose byte ranges are written, checked and read apart.

A *sliced value* is a value that begins with a slice table::

    header   4s magic b"KVSL", u16 version 1, u16 0, u32 slices, u32 header_len
             slices x u64: each slice's XXH3-64
             slices x u32: each slice's length
             zeros up to header_len (the header is padded to a multiple of 64 bytes)
    slices   back to back, in order

and whose bytes are nothing else: ``header_len + sum(lengths) == len(value)``. The
connector stores one block of every layer this way, a slice per layer, so that layer ``i``
can be written as soon as it is computed and read while layer ``i - 1`` computes.

The checksum every party keeps and checks for a value (the one u64 that the wire, the
block directory and the SSD records carry) is, for a sliced value, the XXH3-64 of its
header; for any other value, of its bytes. ``value_checksum`` computes it from the bytes
alone, so a node, a replica and an SSD record treat a sliced value like any other, and
whoever checks a whole value checks every slice with it: a slice that does not match its
table entry makes the value's checksum the header's hash flipped, which never matches. A
reader of a few slices checks the header against the value's checksum (a few hundred bytes)
and each slice it reads against its entry: it hashes no byte it does not read.

Which values are sliced is told by their bytes (the magic, a table that parses, lengths that
add up), as a file format is; a plain value that happens to look like one is checked the
sliced way, which catches the same damage.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import xxhash

from kvstore_client.errors import InvalidValue

MAGIC = b"KVSL"
VERSION = 1
HEAD = struct.Struct("<4sHHII")  # magic, version, 0, slices, header_len
ALIGN = 64  # the header is padded to this: slices start aligned as the value is
MAX_SLICES = 65536
FLIP = (1 << 64) - 1  # a damaged sliced value's checksum is its header's hash XORed with this

_xxh3 = xxhash.xxh3_64_intdigest
_Hasher = xxhash.xxh3_64
_HEAD_SIZE = HEAD.size  # 16
_unpack_head = HEAD.unpack_from


@lru_cache(maxsize=64)
def _table_struct(n: int) -> struct.Struct:
    """The checksums and lengths of a table of ``n`` slices."""
    return struct.Struct(f"<{n}Q{n}I")


def _bytes_of(data) -> memoryview:
    view = data if type(data) is memoryview else memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def header_len(slices: int) -> int:
    """Bytes of the header of a value of ``slices`` slices."""
    return -(-(_HEAD_SIZE + 12 * slices) // ALIGN) * ALIGN


@dataclass(frozen=True)
class SliceTable:
    """Where each slice of a sliced value lies: ``offsets[i]`` (from the value's first byte,
    past the header) and ``lengths[i]``; ``checksums`` as the header states them (empty for a
    table made by ``layout`` before any slice is written); ``size``: the whole value."""

    lengths: tuple[int, ...]
    offsets: tuple[int, ...]
    header_len: int
    size: int
    checksums: tuple[int, ...] = ()

    @property
    def count(self) -> int:
        return len(self.lengths)

    def span(self, first: int, count: int = 1) -> tuple[int, int]:
        """(offset, length) of slices ``first`` .. ``first + count - 1`` together; InvalidValue
        for a range outside the value."""
        if not (0 <= first and count >= 1 and first + count <= len(self.lengths)):
            raise InvalidValue(f"slices {first}..{first + count - 1} are not in a value of {len(self.lengths)} slices")
        start = self.offsets[first]
        last = first + count - 1
        return start, self.offsets[last] + self.lengths[last] - start


def layout(lengths: Sequence[int]) -> SliceTable:
    """The table of a value of slices of ``lengths`` bytes (InvalidValue for none, too many,
    or an empty one)."""
    lengths = tuple(lengths)
    if not 1 <= len(lengths) <= MAX_SLICES:
        raise InvalidValue(f"a sliced value has 1 to {MAX_SLICES} slices, not {len(lengths)}")
    if any(type(n) is not int or not 0 < n < 1 << 32 for n in lengths):
        raise InvalidValue("every slice is 1 byte to 4 GiB long")
    at = header_len(len(lengths))
    offsets = []
    for n in lengths:
        offsets.append(at)
        at += n
    return SliceTable(lengths, tuple(offsets), header_len(len(lengths)), at)


def pack_header(table: SliceTable, checksums: Sequence[int]) -> bytes:
    """The header of a value of ``table``'s slices whose XXH3-64s are ``checksums``."""
    n = table.count
    if len(checksums) != n:
        raise InvalidValue(f"{len(checksums)} checksums for {n} slices")
    body = HEAD.pack(MAGIC, VERSION, 0, n, table.header_len)
    body += _table_struct(n).pack(*checksums, *table.lengths)
    return body + bytes(table.header_len - len(body))


def encode(parts: Sequence) -> bytes:
    """A sliced value of ``parts`` (byte buffers), whole: for values built at once."""
    views = [_bytes_of(p) for p in parts]
    table = layout([len(v) for v in views])
    return b"".join([pack_header(table, [_xxh3(v) for v in views]), *views])


def parse_header(value, size: int | None = None) -> SliceTable | None:
    """The table of a sliced value from its first bytes (at least its header), or None when
    they do not begin one: ``size``, the value's length (default ``len(value)``), must be
    what the table adds up to."""
    if len(value) < _HEAD_SIZE or value[:4] != MAGIC:
        return None
    magic, version, zero, n, head = _unpack_head(value)
    if version != VERSION or zero or not 1 <= n <= MAX_SLICES or head != header_len(n) or len(value) < head:
        return None
    size = len(value) if size is None else size
    fields = _table_struct(n).unpack_from(value, _HEAD_SIZE)
    lengths = fields[n:]
    if 0 in lengths or head + sum(lengths) != size or any(value[_HEAD_SIZE + 12 * n : head]):
        return None
    offsets, at = [], head
    for length in lengths:
        offsets.append(at)
        at += length
    return SliceTable(lengths, tuple(offsets), head, size, fields[:n])


def table_of(value, checksum: int) -> SliceTable | None:
    """The table of ``value`` (a flat byte view of a whole value) when it is a sliced value
    whose checksum is ``checksum``: only its header is read and hashed. None otherwise: a
    plain value, or a header that does not match (damaged, or not this value's)."""
    if len(value) < _HEAD_SIZE or value[:4] != MAGIC:
        return None
    head = _unpack_head(value)[4]
    if not _HEAD_SIZE < head <= len(value):
        return None
    header = bytes(value[:head])
    if _xxh3(header) != checksum:
        return None
    return _parsed(header, len(value))


@lru_cache(maxsize=1024)
def _parsed(header: bytes, size: int) -> SliceTable | None:
    """``parse_header`` of a header already checked, remembered: readers of one value ask for
    its table once per range (the connector, once per layer)."""
    return parse_header(header, size)


def range_preamble(table: SliceTable, first: int, count: int) -> bytes:
    """What precedes a range's bytes on the wire (GET_RANGES): each of its slices' XXH3-64,
    then each one's length."""
    return _table_struct(count).pack(*table.checksums[first : first + count], *table.lengths[first : first + count])


def unpack_preamble(data, count: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(checksums, lengths) of a range's ``count`` slices, from ``range_preamble``'s bytes."""
    fields = _table_struct(count).unpack(data)
    return fields[:count], fields[count:]


def value_checksum(value) -> int:
    """The checksum of a value's bytes (a flat byte view): see the module docstring."""
    if value[:4] != MAGIC:
        return _xxh3(value)
    table = parse_header(value)
    if table is None:
        return _xxh3(value)
    declared = _xxh3(value[: table.header_len])
    for offset, length, checksum in zip(table.offsets, table.lengths, table.checksums):
        if _xxh3(value[offset : offset + length]) != checksum:
            return declared ^ FLIP
    return declared


class SliceHasher:
    """The XXH3-64 of each slice of a run of slices of ``lengths`` bytes, fed in order a piece
    at a time (``update``); ``digests()`` once all of them are in (bytes past the last slice,
    or slices missing, make ``complete`` False)."""

    __slots__ = ("_lengths", "_digests", "_left", "_hasher", "overflow")

    def __init__(self, lengths: Sequence[int]):
        self._lengths = lengths
        self._digests: list[int] = []
        self._left = lengths[0] if lengths else 0  # bytes of the current slice still to come
        self._hasher: xxhash.xxh3_64 | None = None  # the current slice's, when it comes in several pieces
        self.overflow = False

    def update(self, data) -> None:
        view = _bytes_of(data)
        digests, lengths = self._digests, self._lengths
        while len(view):
            left = self._left
            if not left:
                self.overflow = True
                return
            if self._hasher is None and len(view) >= left:  # a whole slice in one piece
                digests.append(_xxh3(view[:left]))
            else:
                hasher = self._hasher
                if hasher is None:
                    hasher = self._hasher = _Hasher()
                take = min(left, len(view))
                hasher.update(view[:take])
                if take < left:
                    self._left -= take
                    return
                digests.append(hasher.intdigest())
                self._hasher = None
            view = view[left:]
            self._left = lengths[len(digests)] if len(digests) < len(lengths) else 0

    @property
    def complete(self) -> bool:
        return not self.overflow and len(self._digests) == len(self._lengths)

    def digests(self) -> list[int]:
        return self._digests


class ValueHasher:
    """``value_checksum`` of a value of ``size`` bytes fed in order, a piece at a time
    (``update``; then ``intdigest``): for bytes hashed as they arrive, while still in cache.
    A plain value costs what one streaming XXH3-64 does; a sliced one, one per slice."""

    __slots__ = ("_size", "_head", "_plain", "_table", "_slices")

    def __init__(self, size: int):
        self._size = size
        self._head: bytearray | None = bytearray()  # the first bytes, until the kind is known
        self._plain: xxhash.xxh3_64 | None = None  # the XXH3-64 of a plain value
        self._table: SliceTable | None = None
        self._slices: SliceHasher | None = None  # a sliced value's

    def update(self, data) -> None:
        plain = self._plain
        if plain is not None:
            plain.update(data)
            return
        slices = self._slices
        if slices is not None:
            slices.update(data)
            return
        view = self._gather(_bytes_of(data))
        if self._slices is not None and len(view):
            self._slices.update(view)

    def _gather(self, view: memoryview) -> memoryview:
        """Take the first bytes until they tell a header from plain bytes; what is left of
        ``view`` past the header (nothing once the value is known to be plain)."""
        head = self._head
        assert head is not None
        if not head and len(view) >= 4 and view[:4] != MAGIC:  # the common case: plain
            self._plain = _Hasher(view)
            self._head = None
            return view[:0]
        while len(view):
            need = _HEAD_SIZE
            if len(head) >= 4 and head[:4] != MAGIC:
                need = 0
            elif len(head) >= _HEAD_SIZE:
                n = _unpack_head(head)[3]
                need = header_len(n) if 1 <= n <= MAX_SLICES and header_len(n) <= self._size else 0
            if not need:
                break
            take = min(need - len(head), len(view))
            head += view[:take]
            view = view[take:]
            if len(head) == need > _HEAD_SIZE:
                table = parse_header(head, self._size)
                if table is None:
                    break
                self._table, self._slices = table, SliceHasher(table.lengths)
                return view
        else:
            return view
        plain = self._plain = _Hasher(bytes(head))
        plain.update(view)
        self._head = None
        return view[:0]

    @property
    def intact(self) -> bool:
        """False for a sliced value a slice of which does not match its table (or is missing):
        bytes no writer may store (a node refuses them), whatever checksum comes with them."""
        table, slices = self._table, self._slices
        if table is None or slices is None:
            return True
        return slices.complete and tuple(slices.digests()) == table.checksums

    def intdigest(self) -> int:
        if self._plain is None and self._slices is None:  # shorter than a header could be
            self._plain = _Hasher(bytes(self._head or b""))
        if self._plain is not None:
            return self._plain.intdigest()
        table, slices = self._table, self._slices
        assert table is not None and slices is not None and self._head is not None
        declared = _xxh3(self._head)
        return declared if self.intact else declared ^ FLIP


__all__ = [
    "ALIGN",
    "MAGIC",
    "MAX_SLICES",
    "SliceHasher",
    "SliceTable",
    "ValueHasher",
    "encode",
    "header_len",
    "layout",
    "pack_header",
    "parse_header",
    "range_preamble",
    "table_of",
    "unpack_preamble",
    "value_checksum",
]
