"""Same-host writes: block bytes are copied into the node's arena through the client's own mapping.

Into the grant the previous put left, when the sizes match: copy, then STORE
with the XXH3-64 of each source (one round trip). Otherwise RESERVE (arena
offsets), copy, COMMIT with the checksums (flag WRITTEN). Either way the
node records the writer's checksums without reading the bytes back (that
read, of bytes another core just wrote, took 30-40% of a 64 MiB batch put),
and every reader verifies them. Both replies carry a grant of the same sizes for the next put
(REGRANT), for puts of at most ``GRANT_MAX_BYTES`` and 1/64 of the arena: a
grant is DRAM set aside for as long as its connection lives.

``ArenaWrites`` is the write half of ``ShmConnection`` (a mixin over a
``DataPlaneConnection`` with the arena mapped at ``_mem``). Frames:
``proto/dataplane.md``.
"""

from __future__ import annotations

import struct

import xxhash

from kvstore_client.errors import ProtocolError
from kvstore_client.transport import KEYS_PER_FRAME, _split
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

_checksum = xxhash.xxh3_64_intdigest


class ArenaWrites:
    """The put path of a same-host connection. ``_grant`` is (id, sizes, offsets) of the
    arena space the node set aside for the next put, or None."""

    _grant: tuple | None = None

    def _put(self, ready: dict[int, tuple], results: list) -> None:
        """Write each chunk into arena space the node set aside, then have it published: into
        the grant left by the previous put when the sizes match (one STORE round trip, with
        the checksums of the sources), else RESERVE, copy, COMMIT with those checksums
        (WRITTEN). Both ask for a grant of the same sizes for the next put (REGRANT)."""
        costs = {i: len(view) for i, (_, view, _) in ready.items()}
        for chunk in _split(list(ready), costs, self.max_frame_bytes, KEYS_PER_FRAME):
            sizes = [len(ready[i][1]) for i in chunk]
            grant, self._grant = self._grant, None
            if grant is not None and grant[1] == sizes:
                statuses = self._store(grant[0], [ready[i] for i in chunk], grant[2])
            else:
                if grant is not None:
                    self._drop_grant(grant)
                statuses = self._reserve_and_commit(ready, chunk)
            for i, status in zip(chunk, statuses):
                results[i] = None if status == Status.OK else error_for(status)

    def _store(self, grant_id: int, items: list[tuple], offsets: list[int]) -> list[int]:
        """Copy ``items`` (key, view, depth) into a grant's space and STORE them (REGRANT)."""
        table = [U64.pack(grant_id)]
        for (key, view, depth), offset in zip(items, offsets):
            self._mem[offset : offset + len(view)] = view
            table.append(put_entry(key, depth, len(view), _checksum(view)))  # of the source: see op_store
        with self._stream():
            return self._publish(Op.STORE, b"".join(table), [len(v) for _, v, _ in items])

    def _reserve_and_commit(self, ready: dict[int, tuple], chunk: list[int]) -> list[int]:
        reservation_id, items = self._reserve(ready, chunk)
        statuses = [status for status, _ in items]
        if not reservation_id:
            return statuses
        checksums = []
        for i, (status, offset) in zip(chunk, items):
            view = ready[i][1]
            if status == Status.OK:
                self._mem[offset : offset + len(view)] = view
            checksums.append(_checksum(view) if status == Status.OK else 0)
        with self._stream():
            table = U64.pack(reservation_id) + struct.pack(f"<{len(chunk)}Q", *checksums)
            committed = self._publish(Op.COMMIT, table, [len(ready[i][1]) for i in chunk], FLAG_WRITTEN)
        return [s if s != Status.OK else c for s, c in zip(statuses, committed)]

    def _publish(self, op: int, table: bytes, sizes: list[int], flags: int = 0) -> list[int]:
        """Send a COMMIT or STORE; its statuses. Small puts ask for a grant of the same sizes
        for the next put (larger ones would hold too much DRAM idle, and gain little)."""
        regrant = sum(sizes) <= min(GRANT_MAX_BYTES, len(self._mem) // 64)
        request_id = self._send(op, len(sizes), table, flags=flags | (FLAG_REGRANT if regrant else 0))
        if not regrant:
            statuses = [Status.OK] * len(sizes)
            self._statuses(op, list(range(len(sizes))), request_id, statuses)
            return statuses
        return self._statuses_and_grant(op, request_id, sizes)

    def _statuses_and_grant(self, op: int, request_id: int, sizes: list[int]) -> list[int]:
        """Read a REGRANT reply: the statuses, then keep the grant when all of it was granted."""
        n = len(sizes)
        if self._reply(op, request_id, n) != n + U64.size + n * RESERVED_ITEM.size:
            raise ProtocolError("REGRANT reply body_len does not match its count")
        body = self._reader.read(n + U64.size + n * RESERVED_ITEM.size)
        statuses = list(body[:n])
        grant_id = U64.unpack_from(body, n)[0]
        granted = list(RESERVED_ITEM.iter_unpack(body[n + U64.size :]))
        for (status, offset), size in zip(granted, sizes):
            if status == Status.OK and offset + size > len(self._mem):
                raise ProtocolError(f"the node granted {size} bytes at {offset}, outside its arena")
        grant = (grant_id, sizes, [offset for _, offset in granted])
        if grant_id and all(status == Status.OK for status, _ in granted):
            self._grant = grant
        elif grant_id:
            self._drop_grant(grant)
        return statuses

    def _drop_grant(self, grant: tuple) -> None:
        """Give a grant's space back (COMMIT with ABORT, no reply: stream order applies it)."""
        if self._dead is None:
            with self._stream():
                table = U64.pack(grant[0]) + bytes(U64.size * len(grant[1]))
                self._send(Op.COMMIT, len(grant[1]), table, flags=FLAG_ABORT | FLAG_NO_REPLY)

    def _reserve(self, ready: dict[int, tuple], chunk: list[int]) -> tuple[int, list[tuple[int, int]]]:
        """RESERVE arena space for the chunk's items: (reservation id, [(status, offset)])."""
        size = U64.size + len(chunk) * RESERVED_ITEM.size
        with self._stream():
            table = b"".join([reserve_entry(ready[i][0], ready[i][2], len(ready[i][1])) for i in chunk])
            if self._reply(Op.RESERVE, self._send(Op.RESERVE, len(chunk), table), len(chunk)) != size:
                raise ProtocolError("RESERVE reply body_len does not match its count")
            body = self._reader.read(size)
            items = list(RESERVED_ITEM.iter_unpack(body[U64.size :]))
            for i, (status, offset) in zip(chunk, items):
                if status == Status.OK and offset + len(ready[i][1]) > len(self._mem):
                    raise ProtocolError(f"the node reserved {len(ready[i][1])} bytes at {offset}, outside its arena")
            return U64.unpack_from(body)[0], items
