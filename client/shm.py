"""Same-host data-plane connection: block bytes move through the node's shared-memory arena.

    ShmConnection("/run/kvstore.sock")   the node's Unix socket carries only small
                                         control frames (the node serves the arena's
                                         writes and leases over it alone, not over TCP)

Reads, fast path: look the key up in the node's block directory (a second
shared-memory file, ``kvstore_client.directory``), copy the block out of the
arena and validate the copy (the directory slot unchanged, and the XXH3-64
when verifying): no round trip at all. Such reads are reported to the node in
batches (TOUCH frames, with the next request or every ``TOUCH_BATCH`` reads
or ``TOUCH_DELAY`` seconds) so they count as hits for eviction.

Reads otherwise (a block not in the directory, a copy that failed validation):
LEASE (the node pins the blocks in place and says where they are in its arena),
copy into the caller's buffer, verify the XXH3-64 (each MiB hashed in the arena
just before it is copied: ``kvstore_client.checked_copy``). The lease is not
released by a frame of its own: its id rides along with the connection's next
request (a RELEASE frame sent in the same ``sendall``), or goes out at once with
``flush()``; the node expires leases older than its lease TTL, so an idle client
pins nothing for long. A copy that ended later than the lease TTL after its
LEASE was sent may have raced such an expiry (and a writer reusing the space),
and one that fails its checksum is damaged: either way the block is leased and
copied once more, then, if that fails too, read over the socket. With
``verify=False`` no checksum is computed. Blocks stored only on SSD that the
node cannot bring into DRAM are read with GET over the socket.

Writes go through arena space the node reserved (``kvstore_client.shm_writes``):
a run of same-sized puts takes one round trip each.

``lease_many`` hands out zero-copy views instead (``ShmLease``); those leases
are taken with FLAG_HOLD, never expire, and end with ``ShmLease.release``.

A connection is NOT thread-safe: one per thread. Frames: ``proto/dataplane.md``.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from typing import Sequence
from functools import partial

from kvstore_client.arenamap import map_arena, unmap_arena
from kvstore_client.buffers import buffer_view
from kvstore_client.checked_copy import copy_verified
from kvstore_client.credentials import NO_CREDENTIALS
from kvstore_client.cuda import DeviceView
from kvstore_client.directory import ONE_SIDED_READS, DirectoryReader, OneSidedReads
from kvstore_client.errors import (
    BufferTooSmall,
    ChecksumMismatch,
    InvalidValue,
    KVStoreError,
    ProtocolError,
    TransportError,
)
from kvstore_client.hostid import machine_id
from kvstore_client.shm_writes import ArenaWrites
from kvstore_client.slices import value_checksum
from kvstore_client.keys import BlockKey, check_key
from kvstore_client.transport import (
    DEFAULT_TUNING,
    DataPlaneConnection,
    Tuning,
    _connect,
    _raise_first,
    _range,
    _split,
)
from kvstore_client.wire import (
    FLAG_HOLD,
    FLAG_NO_REPLY,
    LEASE_ITEM,
    U64,
    Op,
    Status,
    error_for,
    key_entry,
)

log = logging.getLogger(__name__)
TOUCH_BATCH = 64  # one-sided reads reported to the node in one TOUCH frame
TOUCH_DELAY = 0.25  # seconds a one-sided read waits, at most, to be reported (checked on the next read)

_checksum = value_checksum
_LEASE, _OK, _NOT_FOUND = int(Op.LEASE), int(Status.OK), int(Status.NOT_FOUND)
_NOT_IN_DRAM, _FRAME_TOO_LARGE = int(Status.NOT_IN_DRAM), int(Status.FRAME_TOO_LARGE)
_unpack_id = U64.unpack_from
_unpack_item = LEASE_ITEM.unpack_from
_ITEM = LEASE_ITEM.size
_monotonic = time.monotonic
_FIRST = (0,)  # the index list of a one-key request
_NEVER = float("inf")


class ShmLease:
    """Zero-copy, read-only views of blocks leased in a node's arena (``views[j]``
    is None for a miss or a block that is not in DRAM; ``checksums[j]``, what it was stored with). The node keeps the
    bytes in place, unevicted, until ``release`` (or the connection closes);
    these leases do not expire. Drop the views before releasing. A context manager."""

    def __init__(self, conn: "ShmConnection", views: list, lease_ids: list[int], checksums: list[int] | None = None):
        self.views = views
        self.checksums = checksums if checksums is not None else [0] * len(views)
        self._conn, self._ids = conn, lease_ids

    def release(self) -> None:
        for view in self.views:
            if view is not None:
                try:
                    view.release()
                except BufferError:  # the caller kept something made from it: its bytes may now change
                    pass
        ids, self._ids = self._ids, []
        self._conn._release_now(ids)

    def __enter__(self) -> "ShmLease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class ShmConnection(ArenaWrites, DataPlaneConnection):
    """Same-host transport: maps the node's DRAM arena (read/write) and copies
    blocks straight between it and caller buffers (see the module docstring).
    ``target`` is the node's Unix socket path (the node refuses arena writes and leases
    over TCP, with SAME_HOST_ONLY). One per thread.
    """

    def __init__(
        self,
        target: str,
        arena_name: str | None = None,
        *,
        verify: bool = True,
        timeout: float | None = None,
        one_sided: bool = True,
        credentials=NO_CREDENTIALS,
        tuning: Tuning = DEFAULT_TUNING,
    ):
        self.target = target
        self._grants: list = []  # arena space set aside for our next puts (ArenaWrites)
        super().__init__(
            _connect(target, timeout), verify=verify, credentials=credentials, tuning=tuning
        )  # authenticates before mapping
        ttl = self._info.get("lease_ttl")
        self.lease_ttl: float | None = None if ttl is None else float(ttl)  # the node's, from INFO
        self._direct: OneSidedReads | None = None  # reads through the node's block directory
        self._touch_due = _NEVER  # when the oldest unreported one-sided read must be reported
        try:
            self._mem = self._map_arena(arena_name)
            directory = self._map_directory() if one_sided and ONE_SIDED_READS else None
            if directory is not None:
                self._direct = OneSidedReads(directory, self._mem, verify)
        except BaseException:
            self.close()
            raise

    def _map_arena(self, arena_name: str | None) -> memoryview:
        info = self._info
        if info.get("machine_id") != machine_id():
            raise TransportError(f"node at {self.target} runs on another host: use TcpConnection")
        name = os.path.basename(arena_name or info["arena"])
        if name != info["arena"]:
            raise TransportError(
                f"arena {name!r} is not the node's (it serves {info['arena']!r}): "
                "the node restarted since its address was looked up"
            )
        path = os.path.join(os.path.dirname(info["arena_path"]), name)
        try:
            self._arena, view = map_arena(path)
        except OSError as exc:
            raise TransportError(f"cannot map the node's arena {path}: {exc}") from exc
        return view

    def _map_directory(self) -> DirectoryReader | None:
        """The node's block directory, or None (an older node, or one without a directory)."""
        name = self._info.get("directory")
        if not name:
            return None
        path = os.path.join(os.path.dirname(self._info["arena_path"]), os.path.basename(name))
        try:
            return DirectoryReader(path, len(self._mem))
        except (OSError, ValueError) as exc:
            log.info("not reading the block directory of %s (%s): every read takes a lease", self.target, exc)
            return None

    @property
    def one_sided(self) -> bool:
        """Whether reads try the node's block directory first (no round trip)."""
        return self._direct is not None

    # -- one-sided reads -----------------------------------------------------------------------
    def _hit(self, key: BlockKey) -> None:
        """Count a one-sided read: reported to the node in batches (TOUCH) so it counts as a hit."""
        self._touched.append(key_entry(key))
        if len(self._touched) == 1:
            self._touch_due = _monotonic() + TOUCH_DELAY
        elif len(self._touched) >= TOUCH_BATCH or _monotonic() >= self._touch_due:
            self._report_touches()

    def _report_touches(self) -> None:
        """Send the pending TOUCH (and RELEASE) frames now, without waiting for anything.
        A failure closes the connection (its next request raises); the read that got here stands."""
        if self._dead is None:
            try:
                with self._stream():
                    self._sock.sendall(self._lead_frames())
            except TransportError:
                pass

    def holds(self, keys: list) -> list[bool]:
        """Whether the node's block directory lists each (checked) key now: where a reader
        finds this host's blocks without asking the master (False without a directory)."""
        direct = self._direct
        if direct is None:
            return [False] * len(keys)
        return [direct.holds(key) for key in keys]

    def read_direct(self, keys: list, views: list | None = None) -> list:
        """One-sided reads only, of checked keys: each block's bytes (or, with ``views``, its size
        once copied into ``views[j]``); None where that did not work, which is NOT a miss: the
        block may still be on SSD, outside the directory or changing. Never asks the node."""
        if self._direct is None:
            return [None] * len(keys)
        return list(map(self.read_direct_one, keys, [None] * len(keys) if views is None else views))

    def read_direct_one(self, key: BlockKey, view: memoryview | DeviceView | None = None):
        """``read_direct`` of one checked key: its size once copied into ``view`` (a writable
        byte view), or without one its bytes; None where that did not work."""
        direct = self._direct
        if direct is None:
            return None
        if self._unacked:  # read this connection's own puts
            self.settle()
        got = direct.read(key) if view is None else direct.read_into(key, view)
        if got is not None:
            self._hit(key)
        return got

    # -- reads -----------------------------------------------------------------------------
    def _read_views(self, keys: list, views: list | None) -> tuple[list, dict[int, KVStoreError]]:
        """One-sided reads first; what they did not serve is leased (or read over the socket)."""
        if self._direct is None:
            return super()._read_views(keys, views)
        results = self.read_direct(keys, views)
        rest = [j for j, got in enumerate(results) if got is None]
        errors: dict[int, KVStoreError] = {}
        if rest:
            more, failed = super()._read_views(
                [keys[j] for j in rest], None if views is None else [views[j] for j in rest]
            )
            for j, got in zip(rest, more):
                results[j] = got
            errors = {rest[i]: error for i, error in failed.items()}
        return results, errors

    def read_ranges(self, keys, ranges, buffers) -> tuple[list, dict[int, KVStoreError]]:
        """``DataPlaneConnection.read_ranges``: one-sided reads through the block directory
        first (the value's header checked once, each slice copied and checked); what they
        did not serve is asked for over the socket (GET_RANGES)."""
        if self._direct is None:
            return super().read_ranges(keys, ranges, buffers)
        keys = [check_key(k) for k in keys]
        views = [buffer_view(b, writable=True) for b in buffers]
        ranges = [_range(r) for r in ranges]
        if not len(keys) == len(views) == len(ranges):
            raise InvalidValue(f"{len(keys)} keys, {len(ranges)} ranges and {len(views)} buffers")
        if self._unacked:  # read this connection's own puts
            self.settle()
        direct = self._direct
        results = [direct.read_range_into(k, first, count, v) for k, (first, count), v in zip(keys, ranges, views)]
        for key, got in zip(keys, results):
            if got is not None:
                self._hit(key)
        rest = [j for j, got in enumerate(results) if got is None]
        errors: dict[int, KVStoreError] = {}
        if rest:
            more, failed = super().read_ranges(
                [keys[j] for j in rest], [ranges[j] for j in rest], [views[j] for j in rest]
            )
            for j, got in zip(rest, more):
                results[j] = got
            errors = {rest[i]: error for i, error in failed.items()}
        return results, errors

    def get_into(self, key: BlockKey, buffer) -> int | None:
        """One block into ``buffer``: its size, None for a miss.

        The hot path: a one-sided read through the block directory (one copy,
        one checksum, no round trip). Else one LEASE round trip (carrying the
        release of the previous read's lease), one copy, one checksum. A damaged
        copy is leased and copied once more, then read over the socket, as is a
        block the node could not bring into DRAM.
        """
        key = check_key(key)
        view = buffer_view(buffer, writable=True)
        size = self.read_direct_one(key, view)
        if size is not None:
            return size
        sent = _monotonic()
        lease_id, ((status, offset, size, checksum),) = self._lease((key,), _FIRST, 0)
        if status != _OK:
            if status == _NOT_FOUND:
                return None
            if status == _NOT_IN_DRAM:
                return self._read_one(key, view, lease=False)
            raise error_for(status)
        try:
            if size > len(view):
                raise BufferTooSmall(f"block 0 is {size} bytes, buffer holds {len(view)}", size)
            if offset + size > len(self._mem):
                raise ProtocolError(f"lease of {size} bytes at {offset} lies outside the arena")
            out = view if size == len(view) else view[:size]
            intact = copy_verified(out, self._mem[offset : offset + size], checksum, self.verify)
            if intact and _monotonic() - sent < (self.lease_ttl or _NEVER):  # and still leased when copied
                return size
        finally:
            self._finished.append(lease_id)  # released with our next request
        return self._read_one(key, view, lease=True)  # damaged: lease once more, then the socket

    def _read_one(self, key: BlockKey, view: memoryview | DeviceView, lease: bool) -> int | None:
        """get_into's slow path: lease and copy once more (no retry after), or read over the socket."""
        result: list = [None]
        errors: dict[int, KVStoreError] = {}

        def target(j: int, size: int | None):
            result[0] = size
            if size is None:
                return None
            if size > len(view):  # replaced by a bigger block since the first lease
                errors[0] = BufferTooSmall(f"block 0 is {size} bytes, buffer holds {len(view)}", size)
                result[0] = None
                return None
            return view if size == len(view) else view[:size]

        read = partial(self._read, retry=False) if lease else partial(DataPlaneConnection._read, self)
        self._read_checked([key], [0], [len(view)], target, errors, read=read)
        if errors:
            raise errors[0]
        return result[0]

    def _read(
        self, keys: list, todo: list[int], costs: list[int], target, errors: dict, landed=None, retry: bool = True
    ) -> None:
        """Lease, copy and verify; a damaged copy is leased and copied once more (``retry``),
        then read over the socket, as are blocks the node could not bring into DRAM.
        ``landed()``, when given, runs once the leased copies are done, and after each socket reply."""
        later, damaged = self._copy_leased(keys, todo, costs, target, errors)
        if damaged and retry:  # a lease expired before its copy ended, and a writer reused the space
            for j in damaged:
                target(j, None)
            more, damaged = self._copy_leased(keys, damaged, costs, target, errors)
            later += more
        for j in damaged:
            target(j, None)
        later += damaged
        if landed is not None:
            landed()
        if later:
            super()._read(keys, sorted(later), costs, target, errors, landed)

    _read_single = _read  # one key takes the same lease path (the socket's GET is the fallback)

    def _copy_leased(self, keys: list, todo: list[int], costs: list[int], target, errors: dict):
        """LEASE keys[j] for j in todo and copy each leased block into ``target(j, size)``.
        Returns (indices stored but not in DRAM, indices whose copy is damaged)."""
        mem, verify, ttl = self._mem, self.verify, self.lease_ttl
        arena_size = len(mem)
        later, damaged = [], []
        while todo:
            deferred = []
            chunks = [todo] if len(todo) == 1 else _split(todo, costs, self.max_frame_bytes, self.keys_per_frame)
            for chunk in chunks:
                sent = _monotonic()
                lease_id, items = self._lease(keys, chunk, 0)
                try:
                    for j, (status, offset, size, checksum) in zip(chunk, items):
                        if status == _OK:
                            if offset + size > arena_size:
                                raise ProtocolError(f"lease of {size} bytes at {offset} lies outside the arena")
                            out = target(j, size)
                            if out is None:
                                continue
                            if not copy_verified(out, mem[offset : offset + size], checksum, verify):
                                damaged.append(j)
                        elif status == _NOT_IN_DRAM:
                            later.append(j)
                        elif status == _FRAME_TOO_LARGE and j != chunk[0]:  # the first is always served
                            deferred.append(j)
                        elif status != _NOT_FOUND:
                            errors[j] = error_for(status)
                finally:
                    if lease_id:
                        self._finished.append(lease_id)  # released with our next request
                if ttl is not None and _monotonic() - sent >= ttl:  # the lease may have lapsed
                    seen = set(damaged)
                    damaged += [
                        j for j, item in zip(chunk, items) if item[0] == _OK and j not in errors and j not in seen
                    ]
            todo = deferred
        return later, damaged

    def _lease(self, keys: Sequence[BlockKey], chunk: Sequence[int], flags: int) -> tuple[int, list[tuple]]:
        """One LEASE round trip for keys[j], j in chunk: (lease id, [(status, offset, size, checksum)])."""
        n = len(chunk)
        table = key_entry(keys[chunk[0]]) if n == 1 else b"".join([key_entry(keys[j]) for j in chunk])
        size = U64.size + n * _ITEM
        with self._stream():
            if self._reply(_LEASE, self._send(_LEASE, n, table, flags=flags), n) != size:
                raise ProtocolError("LEASE reply body_len does not match its count")
            body = self._reader.read(size)
            if n == 1:
                return _unpack_id(body)[0], [_unpack_item(body, U64.size)]
            return _unpack_id(body)[0], list(LEASE_ITEM.iter_unpack(body[U64.size :]))

    def lease_many(self, keys) -> ShmLease:
        """Lease blocks and return zero-copy views of them (see ShmLease), each verified whole."""
        lease = self.hold(keys)
        if self.verify:
            errors: dict[int, KVStoreError] = {
                j: ChecksumMismatch(f"leased block {j} does not match its checksum")
                for j, (view, checksum) in enumerate(zip(lease.views, lease.checksums))
                if view is not None and _checksum(view) != checksum
            }
            if errors:
                lease.release()
                _raise_first(errors)
        return lease

    def hold(self, keys) -> ShmLease:
        """Lease blocks (HOLD: until released) and return zero-copy views of them with the
        checksums they were stored with, unverified: for a reader that checks only what it
        reads of them (the slices of a sliced value, ``kvstore_client.objects``)."""
        keys = [check_key(k) for k in keys]
        views: list = [None] * len(keys)
        checksums = [0] * len(keys)
        errors: dict[int, KVStoreError] = {}
        ids: list[int] = []
        mem, todo = self._mem, list(range(len(keys)))
        try:
            while todo:
                deferred = []
                for chunk in _split(todo, [0] * len(keys), self.max_frame_bytes, self.keys_per_frame):
                    lease_id, items = self._lease(keys, chunk, FLAG_HOLD)
                    if lease_id:
                        ids.append(lease_id)
                    for j, (status, offset, size, checksum) in zip(chunk, items):
                        if status == _OK:
                            if offset + size > len(mem):
                                raise ProtocolError(f"lease of {size} bytes at {offset} lies outside the arena")
                            views[j], checksums[j] = mem[offset : offset + size].toreadonly(), checksum
                        elif status == _FRAME_TOO_LARGE and j != chunk[0]:
                            deferred.append(j)
                        elif status not in (_NOT_FOUND, _NOT_IN_DRAM):
                            errors[j] = error_for(status)
                todo = deferred
        except BaseException:
            ShmLease(self, views, ids).release()
            raise
        lease = ShmLease(self, views, ids, checksums)
        if errors:
            lease.release()
            _raise_first(errors)
        return lease

    def _release_now(self, lease_ids: list[int]) -> None:
        """RELEASE without waiting (held leases): stream order applies it before our next request."""
        if not lease_ids or self._dead is not None:
            return  # a closed connection's leases are released by the node
        with self._stream():
            self._send(Op.RELEASE, len(lease_ids), struct.pack(f"<{len(lease_ids)}Q", *lease_ids), flags=FLAG_NO_REPLY)

    def close(self) -> None:
        """Close the socket (the node then releases every lease of this connection at once) and unmap."""
        if self._touched:
            self._report_touches()
        super().close()
        direct, self._direct = getattr(self, "_direct", None), None
        if direct is not None:
            direct.close()
        mem = self.__dict__.pop("_mem", None)  # unset until mapped, and after the first close
        if mem is not None:
            try:
                mem.release()
            except BufferError:  # a caller still holds a leased view: the GC unmaps later
                pass
            unmap_arena(self._arena)


__all__ = ["ShmConnection", "ShmLease"]
