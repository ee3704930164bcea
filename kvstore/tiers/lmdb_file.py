"""Checks an lmdb data file before it is mapped: a damaged file must be a clear error, not SIGBUS.

lmdb maps ``data.mdb`` and follows page numbers into the map. A file cut short
(a full disk, a copy stopped half way, a bad restore) still names pages past
its end, and touching one kills the process with SIGBUS before Python can say
why. The two meta pages at the start of the file say how many pages the newest
transaction uses; ``damage`` reads them with plain file reads and compares.
Layout (lmdb's MDB_page header, then MDB_meta; little-endian, 64-bit builds):

    page header 16 bytes | magic u32 | version u32 | address u64 | map size u64 |
    free db (48 bytes; its first u32 is the page size) | main db (48) |
    last page u64 | txn id u64
"""

from __future__ import annotations

import os
import struct

DATA_FILE = "data.mdb"
ON_DAMAGE = ("refuse", "move-aside")  # what a tier does when it finds its file damaged (SsdTier)
MAGIC = 0xBEEFC0DE
_META = struct.Struct("<II8xQI44x48xQQ")  # magic, version, map size, page size, last page, txn id
_META_OFFSET = 16  # after the page header
_MIN_PAGE, _MAX_PAGE = 512, 1 << 16


def damage(directory: str) -> str | None:
    """What is wrong with ``directory``'s lmdb data file, or None when it is absent or whole."""
    path = os.path.join(directory, DATA_FILE)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return None  # created, never written: lmdb initialises it
            first = f.read(_META_OFFSET + _META.size)
            meta = _parse(first)
            if meta is None:
                return f"{path} is not an lmdb data file (no lmdb meta page at its start)"
            page_size = meta[1]
            f.seek(page_size)
            second = _parse(f.read(_META_OFFSET + _META.size))
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{path} cannot be read: {exc.strerror or exc}"
    newest = max((m for m in (meta, second) if m is not None), key=lambda m: m[3])
    needed = (newest[2] + 1) * page_size
    if size < needed:
        return f"{path} is truncated: {size} bytes, its last transaction uses {needed}"
    return None


def _parse(raw: bytes) -> tuple[int, int, int, int] | None:
    """(map size, page size, last page, txn id) of one meta page, or None when it is not one."""
    if len(raw) < _META_OFFSET + _META.size:
        return None
    magic, version, map_size, page_size, last_page, txn_id = _META.unpack_from(raw, _META_OFFSET)
    if magic != MAGIC or not _MIN_PAGE <= page_size <= _MAX_PAGE or page_size & (page_size - 1):
        return None
    return map_size, page_size, last_page, txn_id
