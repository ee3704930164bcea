"""SSD tier: blocks in one lmdb environment, checksummed on every read.

On disk each block is one lmdb record:

    key   = u8 namespace length | namespace UTF-8 | digest
    value = header <4sIQQQ: magic b"KVS\\x02", depth u32, checksum u64, size u64,
            key tag u64> | payload

The header lets open rebuild the index without reading payloads; the
checksum (the block's, ``kvstore_client.slices.value_checksum``) is checked on
every read, so a damaged record is a miss (and is deleted), never wrong bytes.
The key tag, the XXH3-64 of the lmdb key, binds a record to its key: a record
found under another key (pages mixed up, a file edited) is a damaged record
too, not the other key's bytes. Records of the earlier format (``KVS\\x01``,
no key tag) are dropped at open, with the other bad records.

Durability: each put, batch and discard is one lmdb transaction. With
``sync=False`` (default) a commit is in the OS page cache when it returns, so
a process crash, kill -9 included, loses nothing. An OS crash or power cut may
lose the last commits (and, lmdb warns for MDB_NOSYNC, can damage the file,
which must then be deleted): acceptable for a cache, and damaged payloads are
caught by the checksums. ``sync=True`` fsyncs each commit. One process per path.

A full disk makes lmdb fail a commit (as an I/O error: its write came up
short). When the file system then has no room, the tier takes the bytes it
holds as its capacity for now (``disk_limit``; ``capacity_bytes`` says so), so
the store evicts from SSD to its watermarks and writes again, instead of
refusing every write while it holds blocks it could drop. The limit rises
again as the disk frees up (checked at most every ``DISK_RECHECK_S``).

A damaged lmdb file (cut short, or not lmdb at all) is found before it is
mapped (``lmdb_file.damage``), where lmdb would die of SIGBUS: the tier then
refuses to open, saying why, or with ``on_damage="move-aside"`` renames the
file beside it (``data.mdb.damaged-<time>``) and starts empty.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from typing import Iterator

import lmdb
import xxhash

from kvstore_client.errors import BufferTooSmall, CapacityError, ConfigError, InvalidKey, InvalidValue
from kvstore_client.keys import BlockKey
from kvstore_client.slices import value_checksum
from kvstore.sharded import ShardedDict
from kvstore.tiers.lmdb_file import DATA_FILE, ON_DAMAGE, damage
from kvstore.tiers.private import FILE_MODE, private_dir, tighten

MAGIC = b"KVS\x02"  # last byte is the record format version
HEADER = struct.Struct("<4sIQQQ")  # magic, depth, checksum, payload size, XXH3-64 of the lmdb key
_MiB = 1 << 20
log = logging.getLogger(__name__)
_NO_BLOCK = b"\x00"  # an lmdb key no block has (namespaces are non-empty)
DISK_RECHECK_S = 5.0  # how often a tier the disk filled looks for room again
_DISK_SPARE = 4 * _MiB  # free bytes on the file system below which a failed commit means "disk full"


def map_size_for(capacity: int) -> int:
    """lmdb map size for a payload budget of ``capacity`` bytes.

    A value over ~2 KiB takes overflow pages: payload + 24-byte header +
    16-byte page header, rounded up to 4 KiB, so under a page of waste per
    block (25% at 16 KiB blocks, <7% at 64 KiB): the 25%. Keys sit in B-tree
    leaves (~60 bytes each), and copy-on-write needs free pages while pages
    freed by the last commits are not yet reusable: the fixed 32 MiB, which
    also lets discards commit once payloads fill the map. Smaller blocks can
    fill the map before the budget; put then returns False like any full tier.
    The file is sparse: disk use follows the data, not the map size.
    """
    size = int(capacity * 1.25) + 32 * _MiB
    return -(-size // 4096) * 4096


def encode_key(key: BlockKey) -> bytes:
    namespace, digest = key
    ns = namespace.encode()
    if len(ns) > 255:
        raise InvalidKey(f"namespace longer than 255 bytes: {namespace[:40]!r}")
    return bytes((len(ns),)) + ns + digest


def decode_key(raw: memoryview | bytes) -> BlockKey | None:
    """The key stored as ``raw``, or None when it is malformed."""
    raw = bytes(raw)
    if not raw or len(raw) <= 1 + raw[0]:
        return None
    try:
        return (raw[1 : 1 + raw[0]].decode(), raw[1 + raw[0] :])
    except UnicodeDecodeError:
        return None


def key_tag(raw_key: bytes) -> int:
    """What binds a record to its lmdb key (``encode_key``)."""
    return xxhash.xxh3_64_intdigest(raw_key)


def pack_header(raw_key: bytes, depth: int, checksum: int, size: int) -> bytes:
    return HEADER.pack(MAGIC, depth, checksum, size, key_tag(raw_key))


def parse_header(value: memoryview, raw_key) -> tuple[int, int, int] | None:
    """(size, depth, checksum) of the value stored under ``raw_key``, or None when its header
    is bad or names another key."""
    if len(value) < HEADER.size:
        return None
    magic, depth, checksum, size, tag = HEADER.unpack_from(value)
    if magic != MAGIC or size != len(value) - HEADER.size or tag != key_tag(bytes(raw_key)):
        return None
    return size, depth, checksum


def _byte_view(buf: memoryview | bytes | bytearray) -> memoryview:
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class SsdTier:
    """Keyed block storage in lmdb with exact payload-byte accounting.

    Thread-safe. Reads (get, get_into) use their own lmdb read transaction
    and take no lock of this tier, so any number run beside a writer.
    ``_write_lock`` serialises this tier's write transactions (lmdb allows
    one writer anyway) so the budget check, the commit and the index update
    are one step. ``_lock`` guards ``_index``, ``_used`` and the counters and
    is held only for those updates, never across lmdb I/O. Lock order: the
    store's lock, then ``_write_lock``, then ``_lock``. Call close() alone.

    Reopened with a smaller capacity, used_bytes may exceed capacity_bytes
    until the store evicts; puts fail meanwhile.
    """

    name = "ssd"

    def __init__(self, path: str, capacity: int, *, sync: bool = False, on_damage: str = "refuse"):
        if capacity <= 0:
            raise ConfigError(f"ssd tier capacity must be positive, got {capacity}")
        if on_damage not in ON_DAMAGE:
            raise ConfigError(f"on_damage must be one of {list(ON_DAMAGE)}, got {on_damage!r}")
        self.path = path
        self._capacity = capacity
        self._index: ShardedDict = ShardedDict()  # key -> (size, depth)
        self._used = 0
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self.checksum_failures = 0  # reads that found a damaged record (then deleted)
        self.bad_records = 0  # records with a bad key or header, deleted on open
        self.bytes_written = 0  # payload bytes committed since open (what wears the device)
        self.disk_full = 0  # commits that failed because the file system was full
        self._disk_limit: int | None = None  # bytes the tier could hold when the disk filled
        self._disk_checked = 0.0
        private_dir(path)
        for name in ("data.mdb", "lock.mdb"):  # made 0644 by older versions
            tighten(os.path.join(path, name))
        problem = damage(path)
        if problem is None:
            try:
                self._open(sync)
                return
            except lmdb.Error as exc:  # damage only lmdb itself sees (a bad page, a bad version)
                problem = f"{os.path.join(path, DATA_FILE)} cannot be used: {exc}"
        if on_damage == "refuse":
            raise ConfigError(
                f"ssd tier: {problem}; move the file aside (or remove it) to start the tier empty, "
                "or start the node with --ssd-damaged move-aside"
            )
        aside = self._move_aside()
        log.warning("ssd tier: %s; moved it to %s and started the tier empty", problem, aside)
        self._open(sync)

    def _open(self, sync: bool) -> None:
        self._env = lmdb.Environment(
            self.path,
            map_size=map_size_for(self._capacity),
            subdir=True,
            sync=sync,
            metasync=sync,
            readahead=False,
            max_readers=512,
            lock=True,
            mode=FILE_MODE,
        )
        try:
            self._env.reader_check()  # free reader slots left by a killed process
            self._load()
        except BaseException:
            self._env.close()
            raise

    def _move_aside(self) -> str:
        """Rename the damaged data file (kept for a post-mortem) and drop its lock file."""
        data = os.path.join(self.path, DATA_FILE)
        aside = f"{data}.damaged-{time.strftime('%Y%m%dT%H%M%S')}"
        os.replace(data, aside)
        try:
            os.unlink(os.path.join(self.path, "lock.mdb"))
        except FileNotFoundError:
            pass
        return aside

    def _load(self) -> None:
        """Rebuild the index from record headers; delete records that don't parse."""
        index = ShardedDict()  # key -> (size, depth)
        bad: list[bytes] = []
        with self._env.begin(buffers=True) as txn:
            for raw_key, value in txn.cursor():
                key, meta = decode_key(raw_key), parse_header(value, raw_key)
                if key is None or meta is None:
                    bad.append(bytes(raw_key))
                else:
                    index[key] = (meta[0], meta[1])
        if bad:
            with self._env.begin(write=True) as txn:
                for raw_key in bad:
                    txn.delete(raw_key)
        self._index = index
        self._used = sum(size for size, _ in index.values())
        self.bad_records = len(bad)
        if bad:
            log.warning(
                "ssd tier %s: dropped %d records that did not parse, named another key, or were of an earlier format",
                self.path,
                len(bad),
            )

    # -- sizes and index ----------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        """The configured capacity, or less while the disk has no room for it (``disk_limit``)."""
        limit = self._disk_limit
        return self._capacity if limit is None else min(self._capacity, limit)

    @property
    def disk_limit(self) -> int | None:
        """Bytes the tier holds at most while its file system is full (None: not full)."""
        return self._disk_limit

    @property
    def used_bytes(self) -> int:
        """Sum of payload sizes of indexed blocks (exact)."""
        return self._used

    def __len__(self) -> int:
        return len(self._index)

    def contains(self, key: BlockKey) -> bool:
        return key in self._index

    def size_of(self, key: BlockKey) -> int | None:
        meta = self._index.get(key)
        return None if meta is None else meta[0]

    def depth_of(self, key: BlockKey) -> int:
        meta = self._index.get(key)
        return 0 if meta is None else meta[1]

    def keys(self) -> Iterator[BlockKey]:
        with self._lock:
            return iter(list(self._index))

    def inventory(self) -> list[tuple[BlockKey, int, int]]:
        """(key, size, depth) of every block, for the store to re-index on open."""
        with self._lock:
            return [(key, size, depth) for key, (size, depth) in self._index.items()]

    # -- writes ------------------------------------------------------------------
    def put(self, key: BlockKey, value: memoryview | bytes, checksum: int, depth: int = 0) -> bool:
        """Store ``value`` (replacing ``key``); False when it does not fit.

        ``checksum`` is the caller's XXH3-64 of ``value``, stored as given."""
        return self.put_many([(key, value, checksum, depth)])[0]

    def put_many(self, items: list[tuple[BlockKey, memoryview | bytes, int, int]]) -> list[bool]:
        """Store a batch in one write transaction; per item, whether it was stored.

        Items over the budget are skipped. If lmdb's map fills, the batch is
        redone in one transaction that keeps, in order, every item that fits.
        """
        with self._write_lock:
            if self._disk_limit is not None:
                self._recheck_disk()
            records, todo = self._plan(items)
            try:
                done = self._commit(records, todo, partial=False) if todo else []
                if done is None:
                    self._advance_txn()
                    done = self._commit(records, todo, partial=True)
            except lmdb.Error:
                if not self._disk_is_full():
                    raise
                self._limit_to_disk(sum(records[i][2].nbytes for i in todo))
                done = []
            self._apply(items, records, done)
        stored = set(done)
        return [i in stored for i in range(len(items))]

    def _disk_is_full(self) -> bool:
        try:
            st = os.statvfs(self.path)
        except OSError:
            return False
        return st.f_bavail * st.f_frsize < _DISK_SPARE

    def _limit_to_disk(self, refused: int) -> None:
        """A commit failed for want of disk: hold no more than now until the disk frees up."""
        with self._lock:
            self.disk_full += 1
            self._disk_limit = self._used
            self._disk_checked = time.monotonic()
        self._advance_txn()  # pages freed from now on become reusable one commit sooner
        log.warning(
            "ssd tier %s: the disk is full (a write of %d bytes failed); holding at most %d bytes "
            "(of %d configured) until it has room, evicting to make room for new blocks",
            self.path,
            refused,
            self._used,
            self._capacity,
        )

    def _recheck_disk(self) -> None:
        """Raise ``disk_limit`` by what the file system has free now (at most every DISK_RECHECK_S)."""
        now = time.monotonic()
        if now - self._disk_checked < DISK_RECHECK_S:
            return
        self._disk_checked = now
        try:
            st = os.statvfs(self.path)
        except OSError:
            return
        room = st.f_bavail * st.f_frsize - _DISK_SPARE
        with self._lock:
            limit = self._disk_limit
            if limit is None or room <= 0:
                return
            self._disk_limit = None if self._used + room >= self._capacity else max(limit, self._used + room)
        if self._disk_limit is None:
            log.info("ssd tier %s: the disk has room again for the configured %d bytes", self.path, self._capacity)

    def _plan(self, items) -> tuple[list[tuple[bytes, bytes, memoryview]], list[int]]:
        """Encoded (key, header, payload) per item, and the items that fit the budget, in order."""
        records, todo = [], []
        capacity = self.capacity_bytes
        with self._lock:
            used, planned = self._used, {}
            for i, (key, value, checksum, depth) in enumerate(items):
                view = _byte_view(value)
                size = view.nbytes
                try:
                    raw_key = encode_key(key)
                    records.append((raw_key, pack_header(raw_key, depth, checksum, size), view))
                except struct.error:
                    raise InvalidValue(f"depth {depth} or checksum {checksum} out of range") from None
                old = planned[key] if key in planned else self._index.get(key, (0, 0))[0]
                if size <= capacity and used - old + size <= capacity:
                    used += size - old
                    planned[key] = size
                    todo.append(i)
        return records, todo

    def _commit(self, records, todo: list[int], *, partial: bool) -> list[int] | None:
        """Put ``todo`` in one txn; the indices committed. When the map fills: None,
        or with ``partial`` skip what does not fit (each item goes in a nested txn)."""
        done: list[int] = []
        txn = self._env.begin(write=True)
        try:
            for i in todo:
                raw_key, header, view = records[i]
                item_txn = self._env.begin(write=True, parent=txn) if partial else txn
                try:
                    item_txn.put(raw_key, b"".join((header, view)))
                    if partial:
                        item_txn.commit()
                except lmdb.MapFullError:
                    if not partial:
                        txn.abort()
                        return None
                    item_txn.abort()
                    continue
                done.append(i)
        except BaseException:
            txn.abort()
            raise
        try:
            txn.commit()
        except lmdb.MapFullError:  # no room left to record the freed pages
            return [] if partial else None
        return done

    def _advance_txn(self) -> None:
        """Commit a no-op write: lmdb reuses pages freed by a commit only after the next one."""
        try:
            with self._env.begin(write=True) as txn:
                txn.put(_NO_BLOCK, b"")
                txn.delete(_NO_BLOCK)
        except lmdb.MapFullError:
            pass

    def _apply(self, items, records, done: list[int]) -> None:
        """Index committed items in commit order (a key may repeat in a batch)."""
        with self._lock:
            for i in done:
                key, size, depth = items[i][0], records[i][2].nbytes, items[i][3]
                old = self._index.get(key)
                self._used += size - (old[0] if old else 0)
                self._index[key] = (size, depth)
                self.bytes_written += size

    def discard(self, key: BlockKey) -> bool:
        """Delete the block; False when it was absent."""
        return self.discard_many([key]) == 1

    def discard_many(self, keys) -> int:
        """Delete blocks in one transaction; how many were present."""
        with self._write_lock:
            present = [key for key in dict.fromkeys(keys) if key in self._index]
            if not present:
                return 0
            try:
                with self._env.begin(write=True) as txn:
                    for key in present:
                        txn.delete(encode_key(key))
            except lmdb.MapFullError as exc:
                raise CapacityError("ssd tier: lmdb map full, cannot commit a delete") from exc
            self._forget(present)
            return len(present)

    def _forget(self, keys) -> None:
        with self._lock:
            for key in keys:
                meta = self._index.pop(key, None)
                if meta is not None:
                    self._used -= meta[0]

    # -- reads -----------------------------------------------------------------
    def get_into(self, key: BlockKey, out: memoryview) -> int | None:
        """Copy the block into ``out``; its size, or None when absent or damaged."""
        got = self.read_into(key, out)
        return None if got is None else got[0]

    def read_into(self, key: BlockKey, out: memoryview) -> tuple[int, int] | None:
        """``get_into`` that also gives the checksum the bytes were verified against:
        (size, checksum), or None (so a promotion need not hash them again)."""
        dst = _byte_view(out)

        def copy(value: memoryview, size: int, checksum: int) -> tuple[int, int] | None:
            if size > len(dst):
                raise BufferTooSmall(f"block is {size} bytes, buffer holds {len(dst)}", size)
            dst[:size] = value[HEADER.size :]
            if value_checksum(dst[:size]) == checksum:
                return size, checksum
            dst[:size] = bytes(size)  # leave no damaged bytes behind in the caller's buffer
            return None

        return self._read(key, copy)

    def get(self, key: BlockKey) -> bytes | None:
        """The block's bytes, or None when absent or damaged."""

        def copy(value: memoryview, size: int, checksum: int) -> bytes | None:
            data = bytes(value[HEADER.size :])
            return data if value_checksum(data) == checksum else None

        return self._read(key, copy)

    def _read(self, key: BlockKey, copy):
        """``copy(value, size, checksum)`` in a read txn; a bad record is dropped and reads as None."""
        if key not in self._index:
            return None
        raw_key = encode_key(key)
        with self._env.begin(buffers=True) as txn:
            value = txn.get(raw_key)
            if value is None:
                return None
            meta = parse_header(value, raw_key)
            result = None if meta is None else copy(value, meta[0], meta[2])
            if result is not None:
                return result
            seen = (bytes(value[: HEADER.size]), len(value))
        self._drop_damaged(key, raw_key, seen)
        return None

    def _drop_damaged(self, key: BlockKey, raw_key: bytes, seen: tuple[bytes, int]) -> None:
        """Count a failed read and delete the record, unless a writer replaced it meanwhile."""
        with self._write_lock:
            with self._lock:
                self.checksum_failures += 1
            with self._env.begin(write=True, buffers=True) as txn:
                value = txn.get(raw_key)
                if value is None or (bytes(value[: HEADER.size]), len(value)) != seen:
                    return
                txn.delete(raw_key)
            self._forget([key])

    def close(self) -> None:
        with self._write_lock:
            self._env.close()
            with self._lock:
                self._index.clear()
                self._used = 0


class SsdView:
    """The SSD tier as code outside the store sees it (``BlockStore.ssd``): sizes and the
    records themselves, read-only. Reads here are checked like the store's, but are not
    counted as hits and never promote."""

    __slots__ = ("_tier",)

    def __init__(self, tier: SsdTier):
        self._tier = tier

    @property
    def capacity_bytes(self) -> int:
        return self._tier.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self._tier.used_bytes

    def __len__(self) -> int:
        return len(self._tier)

    def contains(self, key: BlockKey) -> bool:
        """Whether a record of ``key`` is on SSD (its home, or the copy kept after a promotion)."""
        return self._tier.contains(key)

    def depth_of(self, key: BlockKey) -> int:
        return self._tier.depth_of(key)

    def get(self, key: BlockKey) -> bytes | None:
        return self._tier.get(key)
