"""Same-host writes: block bytes are copied into the node's arena through the client's own mapping.

Into the grant the previous put left, when the sizes match: copy, then STORE
with the XXH3-64 of each source (one round trip). Otherwise RESERVE (arena
offsets), copy, COMMIT with the checksums (flag WRITTEN). Either way the
node records the writer's checksums without reading the bytes back (that
read, of bytes another core just wrote, took 30-40% of a 64 MiB batch put),
and every reader verifies them. Both replies carry a grant of the same sizes for the next put
(REGRANT), for puts of at most ``GRANT_MAX_BYTES`` and 1/64 of the arena: a
grant is DRAM set aside for as long as its connection lives. The node caps the
space it sets aside for same-host writers; when other writers hold all of it,
a RESERVE is refused (SAME_HOST_FULL) and those blocks go over the socket as a
PUT, whose space lives only while its frame is read.

Puts not waited for (``wait=False``) leave the STORE's or COMMIT's reply for
later and keep ``GRANTS_AHEAD`` grants going (the others from RESERVEs with
REGRANT): the client copies its next value into one while the node publishes
the others and the grants their replies bring travel back.

``ArenaWrites`` is the write half of ``ShmConnection`` (a mixin over a
``DataPlaneConnection`` with the arena mapped at ``_mem``). Values in GPU memory are copied
into the arena by the GPU's copy engine and hashed there (``kvstore_client.cuda``). Frames:
``proto/dataplane.md``.
"""

from __future__ import annotations

import struct

from kvstore_client.cuda import DeviceView, copy_to_host
from kvstore_client.errors import ProtocolError
from kvstore_client.slices import value_checksum
from kvstore_client.transport import DataPlaneConnection, _split
from kvstore_client.wire import (
    FLAG_ABORT,
    FLAG_NO_REPLY,
    FLAG_REGRANT,
    FLAG_WRITTEN,
    RESERVED_ITEM,
    U64,
    Op,
    Status,
    error_for,
    put_entry,
    reserve_entry,
)

GRANT_MAX_BYTES = 4 << 20  # puts up to this size (and 1/64 of the arena) keep a grant for the next one
# Grants a writer that does not wait keeps going. With two, a run of 1 MiB puts waited about
# 10 microseconds a put for the grant the put before last brings back; three were 8-10% faster.
GRANTS_AHEAD = 3

_checksum = value_checksum


def _reserve_table(items: list[tuple]) -> bytes:
    """The RESERVE entries of (key, view, depth) items."""
    return b"".join([reserve_entry(key, depth, len(view)) for key, view, depth in items])


class ArenaWrites(DataPlaneConnection):
    """The put path of a same-host connection (``ShmConnection`` puts it in front of
    ``DataPlaneConnection``, whose ``_put`` it replaces). ``_grants`` holds (id, sizes, offsets)
    of the arena space the node set aside for the next puts, oldest first; ``_grants_coming``
    counts the grants that replies not read yet will bring."""

    _grants: list  # set by the connection
    _mem: memoryview  # the node's arena, mapped by the connection
    _grants_coming = 0

    def _put(self, ready: dict[int, tuple], results: list, wait: bool = True) -> None:
        """Write each chunk into arena space the node set aside, then have it published: into
        a grant of the same sizes (one STORE, with the checksums of the sources), else
        RESERVE, copy, COMMIT with those checksums (WRITTEN). Both ask for a grant of the
        same sizes for the next put (REGRANT). Without ``wait`` the STORE or COMMIT is not
        waited for, and more grants are asked for, up to GRANTS_AHEAD. Items refused because
        other writers hold all the space the node sets aside for same-host writes
        (SAME_HOST_FULL: it is capped, ``BlockStore.grant``) go over the socket as a PUT, whose
        space lives only as long as its frame."""
        costs = {i: len(view) for i, (_, view, _) in ready.items()}
        refused: dict[int, tuple] = {}  # the node had no same-host space left for these: sent instead
        for chunk in _split(list(ready), costs, self.max_frame_bytes, self.keys_per_frame):
            items = [ready[i] for i in chunk]
            sizes = [len(view) for _, view, _ in items]
            grant = self._take_grant(sizes, wait)
            if grant is not None:
                statuses = self._store(grant[0], items, grant[2], wait)
            else:
                statuses = self._reserve_and_commit(items, wait)
            if not wait and self._regrant(sizes) and len(self._grants) + self._grants_coming < GRANTS_AHEAD:
                self._ask_grant(items)
            for i, status in zip(chunk, statuses):
                if status == Status.SAME_HOST_FULL:
                    refused[i] = ready[i]
                else:
                    results[i] = None if status == Status.OK else error_for(status)
        if refused:
            super()._put(refused, results, wait)

    def _take_grant(self, sizes: list[int], wait: bool) -> tuple | None:
        """A grant of exactly ``sizes``, giving back the others; without ``wait``, reads the
        replies still to come for one before giving up."""
        grants = self._grants
        while True:
            for n, grant in enumerate(grants):
                if grant[1] == sizes:
                    del grants[n]
                    return grant
            while grants:
                self._drop_grant(grants.pop())
            if wait or not self._grants_coming or not self._unacked:
                return None
            with self._stream():
                self._collect_unacked(len(self._unacked) - 1)

    def _store(self, grant_id: int, items: list[tuple], offsets: list[int], wait: bool) -> list[int]:
        """Copy ``items`` (key, view, depth) into a grant's space and STORE them (REGRANT)."""
        table = [U64.pack(grant_id)]
        checksums = self._copy_in([view for _, view, _ in items], offsets)
        for (key, view, depth), checksum in zip(items, checksums):
            table.append(put_entry(key, depth, len(view), checksum))  # of the source: see op_store
        with self._stream():
            return self._publish(Op.STORE, b"".join(table), items, 0, wait)

    def _reserve_and_commit(self, items: list[tuple], wait: bool) -> list[int]:
        reservation_id, reserved = self._reserve(items)
        statuses = [status for status, _ in reserved]
        if not reservation_id:
            return statuses
        ok = [n for n, (status, _) in enumerate(reserved) if status == Status.OK]
        copied = dict(zip(ok, self._copy_in([items[n][1] for n in ok], [reserved[n][1] for n in ok])))
        checksums = [copied.get(n, 0) for n in range(len(items))]
        with self._stream():
            table = U64.pack(reservation_id) + struct.pack(f"<{len(items)}Q", *checksums)
            committed = self._publish(
                Op.COMMIT, table, items, FLAG_WRITTEN, wait, [status == Status.OK for status in statuses]
            )
        return [s if s != Status.OK else c for s, c in zip(statuses, committed)]

    # -- space for values written piece by piece (kvstore_client.objects) ----------------------
    @property
    def arena(self) -> memoryview:
        """The node's arena as this connection maps it (read and write)."""
        return self._mem

    @property
    def write_ttl(self) -> float | None:
        """Seconds the node keeps a RESERVE's space unpublished before revoking it (INFO)."""
        ttl = self._info.get("write_ttl")
        return None if ttl is None else float(ttl)

    def reserve_space(self, keys: list, sizes: list[int], depths: list[int]) -> list[tuple[int, list[int], list]]:
        """RESERVE arena space for values to be written later, a frame's worth at a time:
        [(reservation id, the indices it covers, [(status, offset)] of each)]. The caller
        writes each value at its offset, then ``commit_space`` or ``abort_space``, within
        ``write_ttl`` of now."""
        groups = []
        costs = dict(enumerate(sizes))
        for chunk in _split(list(range(len(keys))), costs, self.max_frame_bytes, self.keys_per_frame):
            table = b"".join([reserve_entry(keys[j], depths[j], sizes[j]) for j in chunk])
            with self._stream():
                request_id = self._send(Op.RESERVE, len(chunk), table)
                group_id, reserved = self._read_reserved(request_id, [sizes[j] for j in chunk])
            groups.append((group_id, chunk, reserved))
        return groups

    def commit_space(
        self, group_id: int, checksums: list[int], written: bool = True, keys: list | None = None
    ) -> list[int] | None:
        """Publish a ``reserve_space`` group: a status per item. ``written``: ``checksums`` are
        the writer's, recorded as they are (WRITTEN); else the node reads each value back and
        publishes only those that match (what a writer that gave up on some items sends,
        with checksum 0 for those). With ``keys`` (the group's), the reply is not waited for:
        None, and what failed lands in ``put_failures``, as for puts sent without waiting."""
        table = U64.pack(group_id) + struct.pack(f"<{len(checksums)}Q", *checksums)
        n = len(checksums)
        with self._stream():
            request_id = self._send(Op.COMMIT, n, table, flags=FLAG_WRITTEN if written else 0)
            if keys is None:
                return self._status_list(Op.COMMIT, request_id, n)
            self._defer(request_id, keys, lambda request_id: self._status_list(Op.COMMIT, request_id, n))
            return None

    def abort_space(self, group_id: int, count: int) -> None:
        """Give a ``reserve_space`` group back (no reply: stream order applies it)."""
        if self._dead is None and group_id:
            with self._stream():
                self._send(
                    Op.COMMIT, count, U64.pack(group_id) + bytes(U64.size * count), flags=FLAG_ABORT | FLAG_NO_REPLY
                )

    def _copy_in(self, views: list, offsets: list[int]) -> list[int]:
        """Copy each value into the arena at its offset; their XXH3-64s. A host value is hashed
        at its source; a value in device memory (``kvstore_client.cuda.DeviceView``) is copied
        by the GPU's copy engine, all of them before one wait, and hashed in the arena after."""
        mem = self._mem
        checksums: list = []
        staged = []
        for view, offset in zip(views, offsets):
            if type(view) is DeviceView:
                staged.append((len(checksums), mem[offset : offset + len(view)], view))
                checksums.append(0)
                continue
            mem[offset : offset + len(view)] = view
            checksums.append(_checksum(view))
        if staged:
            copy_to_host([(dst, src) for _, dst, src in staged])
            for n, dst, _ in staged:
                checksums[n] = _checksum(dst)
        return checksums

    def _regrant(self, sizes: list[int]) -> bool:
        """Whether puts of ``sizes`` keep a grant: larger ones would hold too much DRAM idle,
        and gain little."""
        return sum(sizes) <= min(GRANT_MAX_BYTES, len(self._mem) // 64)

    def _publish(
        self, op: int, table: bytes, items: list[tuple], flags: int, wait: bool, reported: list[bool] | None = None
    ) -> list[int]:
        """Send a COMMIT or STORE (REGRANT when the sizes keep a grant); its statuses, or, not
        waiting, all OK with the reply left for later (``reported``: the items whose failures
        that reply may still bring, default all)."""
        sizes = [len(view) for _, view, _ in items]
        regrant = self._regrant(sizes)
        request_id = self._send(op, len(sizes), table, flags=flags | (FLAG_REGRANT if regrant else 0))
        self._grants_coming += regrant

        def statuses(request_id: int) -> list[int]:
            if regrant:
                return self._statuses_and_grant(op, request_id, sizes)
            return self._status_list(op, request_id, len(sizes))

        if wait:
            return statuses(request_id)
        keys = [key for n, (key, _, _) in enumerate(items) if reported is None or reported[n]]
        self._defer(
            request_id,
            keys,
            lambda request_id: [s for n, s in enumerate(statuses(request_id)) if reported is None or reported[n]],
        )
        return [Status.OK] * len(sizes)

    def _statuses_and_grant(self, op: int, request_id: int, sizes: list[int]) -> list[int]:
        """Read a REGRANT reply: the statuses, then keep the grant when all of it was granted."""
        n = len(sizes)
        if self._reply(op, request_id, n) != n + U64.size + n * RESERVED_ITEM.size:
            raise ProtocolError("REGRANT reply body_len does not match its count")
        body = self._reader.read(n + U64.size + n * RESERVED_ITEM.size)
        statuses = list(body[:n])
        self._keep_grant(U64.unpack_from(body, n)[0], list(RESERVED_ITEM.iter_unpack(body[n + U64.size :])), sizes)
        return statuses

    def _keep_grant(self, grant_id: int, granted: list[tuple[int, int]], sizes: list[int]) -> None:
        """Keep a grant the node made (give it back unless all of it was granted)."""
        self._grants_coming = max(0, self._grants_coming - 1)
        for (status, offset), size in zip(granted, sizes):
            if status == Status.OK and offset + size > len(self._mem):
                raise ProtocolError(f"the node granted {size} bytes at {offset}, outside its arena")
        grant = (grant_id, sizes, [offset for _, offset in granted])
        if grant_id and all(status == Status.OK for status, _ in granted):
            self._grants.append(grant)
        elif grant_id:
            self._drop_grant(grant)

    def _ask_grant(self, items: list[tuple]) -> None:
        """Ask for one more grant of the items' sizes (RESERVE with REGRANT), reply left for later."""
        sizes = [len(view) for _, view, _ in items]
        with self._stream():
            request_id = self._send(Op.RESERVE, len(items), _reserve_table(items), flags=FLAG_REGRANT)
            self._grants_coming += 1

            def collect(request_id: int) -> list[int]:
                grant_id, granted = self._read_reserved(request_id, sizes)
                self._keep_grant(grant_id, granted, sizes)
                return []  # a grant stores nothing: nothing to report

            self._defer(request_id, [], collect)

    def _drop_grant(self, grant: tuple) -> None:
        """Give a grant's space back (COMMIT with ABORT, no reply: stream order applies it)."""
        if self._dead is None:
            with self._stream():
                table = U64.pack(grant[0]) + bytes(U64.size * len(grant[1]))
                self._send(Op.COMMIT, len(grant[1]), table, flags=FLAG_ABORT | FLAG_NO_REPLY)

    def _reserve(self, items: list[tuple]) -> tuple[int, list[tuple[int, int]]]:
        """RESERVE arena space for ``items``: (reservation id, [(status, offset)])."""
        with self._stream():
            request_id = self._send(Op.RESERVE, len(items), _reserve_table(items))
            return self._read_reserved(request_id, [len(view) for _, view, _ in items])

    def _read_reserved(self, request_id: int, sizes: list[int]) -> tuple[int, list[tuple[int, int]]]:
        """Read a RESERVE reply: (reservation id, [(status, offset)]), each inside the arena."""
        size = U64.size + len(sizes) * RESERVED_ITEM.size
        if self._reply(Op.RESERVE, request_id, len(sizes)) != size:
            raise ProtocolError("RESERVE reply body_len does not match its count")
        body = self._reader.read(size)
        reserved = list(RESERVED_ITEM.iter_unpack(body[U64.size :]))
        for (status, offset), n in zip(reserved, sizes):
            if status == Status.OK and offset + n > len(self._mem):
                raise ProtocolError(f"the node reserved {n} bytes at {offset}, outside its arena")
        return U64.unpack_from(body)[0], reserved
