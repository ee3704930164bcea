"""Sliced values written and read a slice at a time (``Client.open_objects``, ``Client.read_objects``).

A sliced value (``kvstore_client.slices``) is a header, then its slices. An ``ObjectWriter``
opens a batch of them at once, each of known slice lengths, and is handed slice ``i`` of
every value at a time (the vLLM connector: layer ``i`` of every block as soon as the layer
is computed); ``complete`` publishes them, and only then are they indexed, readable and
counted. On a node of this host the bytes go straight into arena space the node set aside
(RESERVE), invisible until the COMMIT that ``complete`` sends; space the node does not set
aside (its share for writers is held by others, or the node is on another host) is staged
in this process and sent whole by ``complete``. A writer that never completes leaves nothing
visible: its space is given back by ``abort``, when its connection ends, or by the node
after ``write_ttl``; before half of that has passed, the writer moves what it wrote out of
the arena into staging, so it never writes into space the node may have given to another.

An ``ObjectReader`` holds a batch of sliced values for reading slice ranges of all of them
at a time (the connector: layer ``i`` of every block, while layer ``i - 1`` computes). On
this host it leases them once (HOLD) and copies each range straight out of the arena,
checking each slice against its own checksum after the value's header was checked once;
elsewhere it asks their nodes for the ranges (GET_RANGES). A value that turns out damaged is
a miss (reported to its node when the reader closes, which drops it), never wrong bytes.

Both belong to the thread that made them (they use its data-plane connections).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import xxhash

from kvstore_client.buffers import buffer_view
from kvstore_client.checked_copy import copy_slices_verified
from kvstore_client.cuda import DeviceView, copy_to_host
from kvstore_client.errors import InvalidValue, KVStoreError, PutFailed
from kvstore_client.keys import BlockKey
from kvstore_client.slices import SliceTable, pack_header, table_of
from kvstore_client.wire import Status, error_for

log = logging.getLogger(__name__)
_xxh3 = xxhash.xxh3_64_intdigest
_monotonic = time.monotonic


class ObjectReader:
    """Slice ranges of a batch of sliced values (see the module docstring). ``routes[j]``:
    (node id, data-plane connection) to read ``keys[j]`` from, or None (a miss). ``slices``:
    the number of slices a value must have (None: any); a value held here with another count
    is a miss at once (one elsewhere, at its first range past its end)."""

    def __init__(self, keys: list[BlockKey], routes: list, verify: bool = True, slices: int | None = None):
        self.keys = keys
        self._verify = verify
        self._slices = slices
        n = len(keys)
        self._held: list[tuple[memoryview, SliceTable, int] | None] = [None] * n  # leased here; its slices
        self._remote: dict[int, list[int]] = {}  # id(conn) -> indices read with GET_RANGES
        self._conns: dict[int, tuple[str, Any]] = {}
        self._leases: list = []
        self._damaged: dict[int, list[int]] = {}  # id(conn) -> indices found damaged
        self._owner: dict[int, int] = {}  # index -> id(conn) of a held value
        self._gone: set[int] = set()  # misses, and values found damaged
        by_conn: dict[int, list[int]] = {}
        for j, route in enumerate(routes):
            if route is None:
                self._gone.add(j)
                continue
            self._conns.setdefault(id(route[1]), route)
            by_conn.setdefault(id(route[1]), []).append(j)
        try:
            for cid, idx in by_conn.items():
                node_id, conn = self._conns[cid]
                if hasattr(conn, "hold"):
                    self._hold(conn, idx)
                else:
                    self._remote[cid] = idx
        except BaseException:
            self.close()
            raise
        held = [(j, h) for j, h in enumerate(self._held) if h is not None]
        self._held_list = [(j, h[0], h[1].checksums) for j, h in held]  # (index, view, slice checksums)
        tables = {h[1].lengths for _, h in held}
        self._same_table = held[0][1][1] if len(tables) == 1 else None  # when every value's slices line up

    def _hold(self, conn, idx: list[int]) -> None:
        """Lease the values of ``idx`` in place and check each one's header once."""
        lease = conn.hold([self.keys[j] for j in idx])
        self._leases.append(lease)
        unleased = []
        for j, view, checksum in zip(idx, lease.views, lease.checksums):
            table = None if view is None else table_of(view, checksum)
            if view is None:  # a miss, or on SSD only with no DRAM free to bring it in: ask the node
                unleased.append(j)
            elif table is None:  # not a sliced value with that checksum: damaged, or plain (the node says which)
                self._damaged.setdefault(id(conn), []).append(j)
                self._gone.add(j)
            elif self._slices is not None and table.count != self._slices:
                self._gone.add(j)
            else:
                self._held[j] = (view, table, table.count)
                self._owner[j] = id(conn)
        if unleased:
            self._remote[id(conn)] = unleased

    def read_into(self, first: int, buffers: Sequence, count: int = 1, *, exact: bool = False) -> list[int | None]:
        """Slices ``first .. first + count - 1`` of every value, back to back, into
        ``buffers[j]``: the bytes copied, or None for a value missing, damaged, or with fewer
        slices (it stays None for later reads), or whose buffer is None (skipped).
        InvalidValue for a buffer too small; with ``exact``, a range of another size than its
        buffer is None instead, and a value held here copies nothing into it."""
        if len(buffers) != len(self.keys):
            raise InvalidValue(f"{len(self.keys)} values but {len(buffers)} buffers")
        results: list[int | None] = [None] * len(self.keys)
        if self._leases:
            self._copy_held(first, count, buffers, results, exact)
        gone = self._gone
        for cid, idx in self._remote.items():
            wanted = [j for j in idx if j not in gone and buffers[j] is not None]
            self._read_remote(cid, wanted, first, count, buffers, results)
            if exact:
                for j in wanted:
                    if results[j] is not None and results[j] != len(buffer_view(buffers[j])):
                        results[j] = None
                        gone.add(j)
        return results

    def _copy_held(self, first: int, count: int, buffers, results: list, exact: bool) -> None:
        """``read_into`` of the values held here: each slice hashed just before it is copied
        (read out of the arena once, copied from cache)."""
        if count == 1 and self._same_table is not None and first < self._same_table.count:
            return self._copy_one_slice(first, buffers, results, exact)
        verify, gone = self._verify, self._gone
        for j, held in enumerate(self._held):
            buffer = buffers[j]
            if held is None or buffer is None or j in gone:
                continue
            view, table, slices = held
            if first + count > slices:
                continue
            offset, length = table.span(first, count)
            dst = buffer_view(buffer, writable=True)
            if len(dst) != length:
                if exact:
                    gone.add(j)
                    continue
                if len(dst) < length:
                    raise InvalidValue(f"buffer {j} holds {len(dst)} bytes, the range {length}")
                dst = dst[:length]
            if not copy_slices_verified(dst, view, table, first, count, verify):
                self._lost(j)
                continue
            results[j] = length

    def _copy_one_slice(self, first: int, buffers, results: list, exact: bool) -> None:
        """``_copy_held`` of one slice of values that all have the same slice lengths (the
        connector's: a layer's slab each): the slice's place is worked out once, and each value
        costs a hash, a copy and a few steps (a buffer of another size, or not a byte
        memoryview, takes the careful path)."""
        table = self._same_table
        assert table is not None
        start, length = table.offsets[first], table.lengths[first]
        end = start + length
        verify, gone, lost = self._verify, self._gone, []
        for j, view, checksums in self._held_list:
            dst = buffers[j]
            if dst is None or (gone and j in gone):
                continue
            src = view[start:end]
            if verify and _xxh3(src) != checksums[first]:
                lost.append(j)
                continue
            if type(dst) is memoryview and len(dst) == length and dst.format == "B":
                dst[:] = src  # the common case (the connector's): a byte view of the slice's size
            elif not self._copy_to(j, dst, src, length, checksums[first], exact):
                continue
            results[j] = length
        for j in lost:
            self._lost(j)

    def _copy_to(self, j: int, buffer, src: memoryview, length: int, checksum: int, exact: bool) -> bool:
        """Copy a checked slice into a buffer that is not a byte view of its size: whether it was."""
        dst = buffer_view(buffer, writable=True)
        if len(dst) != length and exact:
            self._gone.add(j)
            return False
        if len(dst) < length:
            raise InvalidValue(f"buffer {j} holds {len(dst)} bytes, the range {length}")
        if type(dst) is DeviceView:
            return dst[:length].fill_from_host(src, checksum, False)
        dst[:length] = src
        return True

    def _read_remote(self, cid: int, idx: list[int], first: int, count: int, buffers, results: list) -> None:
        if not idx:
            return
        node_id, conn = self._conns[cid]
        try:
            got, errors = conn.read_ranges(
                [self.keys[j] for j in idx], [(first, count)] * len(idx), [buffers[j] for j in idx]
            )
        except (KVStoreError, OSError) as exc:
            log.warning("reading %d slice ranges from %s failed: %s", len(idx), node_id, exc)
            self._gone.update(idx)
            return
        for k, (j, size) in enumerate(zip(idx, got)):
            if size is None:
                if k in errors and not isinstance(errors[k], InvalidValue):
                    log.warning("reading slices of %r from %s failed: %s", self.keys[j], node_id, errors[k])
                self._gone.add(j)
            results[j] = size

    def _lost(self, j: int) -> None:
        """A held value's slice did not match its checksum: a miss from now on, reported at close."""
        self._gone.add(j)
        self._damaged.setdefault(self._owner[j], []).append(j)

    @property
    def missing(self) -> set[int]:
        """Indices of the values not read (missing or damaged) so far."""
        return set(self._gone)

    def close(self) -> None:
        """Release the leases; tell the nodes about values found damaged (they check them whole
        and drop the damaged ones)."""
        leases, self._leases = self._leases, []
        for lease in leases:
            try:
                lease.release()
            except (KVStoreError, OSError):
                pass
        damaged, self._damaged = self._damaged, {}
        for cid, idx in damaged.items():
            node_id, conn = self._conns[cid]
            try:
                conn.verify_many([self.keys[j] for j in idx])
            except (KVStoreError, OSError) as exc:
                log.info("could not report %d damaged values to %s: %s", len(idx), node_id, exc)

    def __enter__(self) -> "ObjectReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Target:
    """One node a batch of objects goes to: its connection, the arena groups it reserved
    ((reservation id, indices), their space in ``ObjectWriter._values``), and the indices
    staged here for it."""

    __slots__ = ("node_id", "conn", "groups", "staged", "reserved_at", "ttl")

    def __init__(self, node_id: str, conn):
        self.node_id, self.conn = node_id, conn
        self.groups: list[tuple[int, list[int]]] = []
        self.staged: list[int] = []
        self.reserved_at = _monotonic()
        self.ttl = getattr(conn, "write_ttl", None)


class ObjectWriter:
    """Sliced values written a slice at a time (see the module docstring). ``targets``:
    (node id, connection, indices) of each node the values go to; ``primaries[j]``, the node
    whose copy of value ``j`` must be stored (the others are replicas, best effort);
    ``stored(keys_and_nodes)`` is told what ``complete`` stored."""

    def __init__(
        self,
        keys: list[BlockKey],
        tables: list[SliceTable],
        depths: list[int],
        targets: list[tuple],
        primaries: list[str],
        stored=None,
    ):
        self.keys, self._tables, self._depths = keys, tables, depths
        self._stored = stored
        n = len(keys)
        self._values: list[list[memoryview]] = [[] for _ in range(n)]  # where each value's bytes go
        self._space: list[list[tuple[_Target, memoryview]]] = [[] for _ in range(n)]  # arena space, per target
        self._staging: list[bytearray | None] = [None] * n
        self._checksums: list[list[int]] = [[0] * t.count for t in tables]
        self._written: list[bytearray] = [bytearray(t.count) for t in tables]
        self._primary = list(primaries)
        self._same_table = tables[0] if tables and all(t is tables[0] for t in tables) else None
        self._targets: list[_Target] = []
        self._open = True
        try:
            for node_id, conn, idx in targets:
                target = _Target(node_id, conn)
                self._targets.append(target)
                self._make_room(target, idx)
        except BaseException:
            self.abort()
            raise

    def _make_room(self, target: _Target, idx: list[int]) -> None:
        """Arena space on ``target`` for each value of ``idx`` (same host), else staging here."""
        conn = target.conn
        if not hasattr(conn, "reserve_space"):
            for j in idx:
                self._stage(target, j)
            return
        sizes = [self._tables[j].size for j in idx]
        groups = conn.reserve_space([self.keys[j] for j in idx], sizes, [self._depths[j] for j in idx])
        arena = conn.arena
        for group_id, chunk, reserved in groups:
            members = [idx[k] for k in chunk]
            if group_id:
                target.groups.append((group_id, members))
            for j, (status, offset) in zip(members, reserved):
                if status == Status.OK:
                    space = arena[offset : offset + self._tables[j].size]
                    self._values[j].append(space)
                    self._space[j].append((target, space))
                else:  # the node's space for writers is held by others: send it whole at the end
                    self._stage(target, j)

    def _stage(self, target: _Target, j: int) -> None:
        target.staged.append(j)
        if self._staging[j] is None:
            staging = self._staging[j] = bytearray(self._tables[j].size)
            self._values[j].append(memoryview(staging))

    # -- writing ---------------------------------------------------------------------------------
    def write(self, index: int, buffers: Sequence) -> None:
        """Slice ``index`` of every value: ``buffers[j]`` (any contiguous buffer, host or CUDA
        memory, exactly that slice's length) for value ``j``; None skips value ``j``."""
        if not self._open:
            raise InvalidValue("this writer was completed or aborted")
        if len(buffers) != len(self.keys):
            raise InvalidValue(f"{len(self.keys)} values but {len(buffers)} buffers")
        self._keep_clear_of_expiry()
        values, checksums, written = self._values, self._checksums, self._written
        shared = self._same_table
        if shared is not None and 0 <= index < shared.count:
            offset, length = shared.offsets[index], shared.lengths[index]
        else:
            offset = length = -1
        end = offset + length
        device: list[tuple[int, DeviceView]] = []
        for j, src in enumerate(buffers):
            if type(src) is memoryview and len(src) == length and src.format == "B":
                homes = values[j]  # the common case (the connector's): a byte view of the slice's size
                checksums[j][index] = _xxh3(src)  # at the source, then copied from cache
                homes[0][offset:end] = src
                for home in homes[1:]:
                    home[offset:end] = src
                written[j][index] = 1
            elif src is not None:
                found = self._write_one(j, index, src)
                if found is not None:
                    device.append(found)
        if device:
            self._write_from_device(index, device)

    def _write_one(self, j: int, index: int, buffer) -> tuple[int, DeviceView] | None:
        """``write`` of one value's slice from any buffer; a CUDA one is returned, to be copied
        with the others."""
        table = self._tables[j]
        if not 0 <= index < table.count:
            raise InvalidValue(f"value {j} has {table.count} slices, not slice {index}")
        src = buffer_view(buffer)
        offset, length = table.offsets[index], table.lengths[index]
        if len(src) != length:
            raise InvalidValue(f"slice {index} of value {j} is {length} bytes, not {len(src)}")
        if type(src) is DeviceView:
            return j, src
        self._checksums[j][index] = _xxh3(src)
        for value in self._values[j]:
            value[offset : offset + length] = src
        self._written[j][index] = 1
        return None

    def _write_from_device(self, index: int, device: list[tuple[int, DeviceView]]) -> None:
        """Slices in GPU memory: the copy engine copies each into its value's first home, all
        before one wait; each is hashed there and copied on to the value's other homes."""
        homes = []
        for j, src in device:
            offset, length = self._tables[j].offsets[index], self._tables[j].lengths[index]
            homes.append((self._values[j][0][offset : offset + length], src))
        copy_to_host(homes)
        for (j, _), (home, _) in zip(device, homes):
            offset, length = self._tables[j].offsets[index], self._tables[j].lengths[index]
            self._checksums[j][index] = _xxh3(home)
            for value in self._values[j][1:]:
                value[offset : offset + length] = home
            self._written[j][index] = 1

    def _keep_clear_of_expiry(self) -> None:
        """Past half the node's write_ttl since a target's RESERVE, move what was written there
        into staging and give the space back: the node revokes it at write_ttl, and then may
        hand it to another writer while this one still writes."""
        now = _monotonic()
        for target in self._targets:
            if target.groups and target.ttl is not None and now - target.reserved_at > target.ttl / 2:
                self._leave_arena(target)

    def _leave_arena(self, target: _Target) -> None:
        groups, target.groups = target.groups, []
        for j in range(len(self.keys)):
            for held in [h for h in self._space[j] if h[0] is target]:
                self._space[j].remove(held)
                space = held[1]
                if self._staging[j] is None:
                    staging = self._staging[j] = bytearray(space)
                    self._values[j].append(memoryview(staging))
                self._values[j] = [v for v in self._values[j] if v is not space]
                target.staged.append(j)
        for group_id, members in groups:
            target.conn.abort_space(group_id, len(members))

    # -- publishing ------------------------------------------------------------------------------
    @property
    def incomplete(self) -> list[int]:
        """Indices of the values some slice of which was not written yet."""
        return [j for j, done in enumerate(self._written) if not all(done)]

    def complete(self, wait: bool = True) -> None:
        """Publish every value whose slices were all written (the others are given up): each
        header is written, then the nodes publish (COMMIT) or receive (PUT) them. Raises
        PutFailed naming the values not stored on their primary node (those given up
        included); replica failures are logged. ``wait=False``: the nodes' answers are not
        waited for (the values' bytes are all with the nodes or in flight when it returns, so
        the caller may reuse its buffers); failures then surface as those of puts sent without
        waiting do (``Client.wait_for_puts``), and only values given up raise here."""
        if not self._open:
            raise InvalidValue("this writer was completed or aborted")
        self._open = False
        incomplete = set(self.incomplete)
        declared = [0] * len(self.keys)
        for j, table in enumerate(self._tables):
            if j not in incomplete:
                header = pack_header(table, self._checksums[j])
                declared[j] = _xxh3(header)
                for value in self._values[j]:
                    value[: table.header_len] = header
        failures: dict[int, tuple] = {
            j: (self.keys[j], self._primary[j], InvalidValue("not every slice was written")) for j in incomplete
        }
        stored: dict[int, list[str]] = {}
        for target in self._targets:
            for j, error in self._publish(target, declared, incomplete, wait).items():
                if error is None:
                    stored.setdefault(j, []).append(target.node_id)
                elif target.node_id == self._primary[j]:
                    failures.setdefault(j, (self.keys[j], target.node_id, error))
                else:
                    log.warning("replica of %r on %s not stored: %s", self.keys[j], target.node_id, error)
        self._release_staging()
        if self._stored is not None:
            self._stored([(self.keys[j], nodes) for j, nodes in stored.items() if j not in failures])
        if failures:
            raise PutFailed([failures[j] for j in sorted(failures)])

    def _publish(
        self, target: _Target, declared: list[int], incomplete: set[int], wait: bool = True
    ) -> dict[int, Exception | None]:
        """One target's values: its arena groups committed, its staged values put; a result per
        index (without ``wait``, None: answers come later)."""
        out: dict[int, Exception | None] = {}
        conn = target.conn
        for group_id, members in target.groups:
            whole = not any(j in incomplete for j in members)
            checksums = [declared[j] for j in members]
            try:  # a group with values given up is read back and checked by the node: those fail
                if wait or not whole:
                    statuses = conn.commit_space(group_id, checksums, written=whole)
                else:
                    conn.commit_space(group_id, checksums, keys=[self.keys[j] for j in members])
                    statuses = [Status.OK] * len(members)
            except (KVStoreError, OSError) as exc:
                statuses = [exc] * len(members)
            for j, status in zip(members, statuses):
                if j not in incomplete:
                    out[j] = (
                        status
                        if isinstance(status, Exception)
                        else (None if status == Status.OK else error_for(status))
                    )
        target.groups = []
        staged = [j for j in target.staged if j not in incomplete]
        if staged:
            items = [(self.keys[j], self._staging[j], self._depths[j]) for j in staged]
            try:
                results = conn.put_many(items, wait)
            except (KVStoreError, OSError) as exc:
                results = [exc] * len(staged)
            out.update(zip(staged, results))
        return out

    def abort(self) -> None:
        """Give every value up: the space reserved goes back, nothing becomes visible."""
        self._open = False
        for target in self._targets:
            groups, target.groups = target.groups, []
            for group_id, members in groups:
                try:
                    target.conn.abort_space(group_id, len(members))
                except (KVStoreError, OSError):
                    pass  # a dead connection gave everything back itself
        self._release_staging()

    def _release_staging(self) -> None:
        self._values = [[] for _ in self.keys]
        self._space = [[] for _ in self.keys]
        self._staging = [None] * len(self.keys)

    def __enter__(self) -> "ObjectWriter":
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if not self._open:
            return
        if kind is None:
            self.complete()
        else:
            self.abort()
