"""The data-plane ops a node serves: one function per op (spec: proto/dataplane.md).

Each op reads the rest of its frame from ``conn.reader``, works on
``conn.store`` and sends exactly one reply (none with NO_REPLY: RELEASE,
TOUCH, COMMIT with ABORT).
Per-item failures become per-item statuses; a frame that contradicts itself
raises ProtocolError, which ends the connection (see connection.py).
Bulk bytes never pass through Python objects: GET sends from the arena
(``sendmsg`` of the leased views), PUT and PULL receive into reservations;
same-host writers fill reservations and grants through their own mapping.
A malformed key is an item status (INVALID_KEY; TOUCH skips it), never an
exception; so is a key of a namespace the connection's token may not use
(PERMISSION_DENIED: ``Connection.admitted``, applied as every table is read). Space held for same-host writers between requests, RESERVE's as
well as grants, is taken with ``store.grant``, so that it all stays under the
store's cap on grants (1/GRANT_SHARE of DRAM); a RESERVE's keys are bound at
COMMIT, and what does not fit under the cap borrows from the server's
node-wide allowance of one frame (allowance.py). Groups of reservations are
lists of ``(Reservation | None, status, (key, depth) | None, bytes borrowed)``:
the binding is None for a grant (STORE names its keys).
"""

from __future__ import annotations

import json
import struct
from typing import TYPE_CHECKING

from kvstore_client.errors import CapacityError, KVStoreError, ProtocolError
from kvstore_client.slices import ValueHasher, parse_header, range_preamble, table_of, value_checksum
from kvstore_client.wire import (
    FLAG_ABORT,
    FLAG_CHECKSUMS_LAST,
    FLAG_HOLD,
    FLAG_NO_REPLY,
    FLAG_REGRANT,
    FLAG_WRITTEN,
    GET_ITEM,
    KEY_HEAD,
    LEASE_ITEM,
    PULL_ENTRY,
    PUT_ENTRY,
    RANGE_ENTRY,
    RANGE_ITEM,
    RESERVE_ENTRY,
    RESERVED_ITEM,
    U64,
    Op,
    Status,
    decode_key,
    status_of,
)

from kvstore.transport.auth import op_auth
from kvstore.transport.leases import release_groups
from kvstore.transport.reservations import EXPIRED

if TYPE_CHECKING:
    from kvstore.transport.connection import Connection, Frame

OK, NOT_FOUND = Status.OK, Status.NOT_FOUND
_checksum = value_checksum


def _bad(message: str) -> ProtocolError:
    return ProtocolError(message, Status.BAD_FRAME)


def op_ping(conn: "Connection", frame: "Frame") -> None:
    conn.reader.skip(frame.body_len)
    conn.reply(frame, 0)


def op_info(conn: "Connection", frame: "Frame") -> None:
    conn.reader.skip(frame.body_len)
    info = conn.server.info()
    if conn.principal is not None and conn.principal.confined:
        # One-sided reads through the block directory would skip the namespace check (the
        # directory lists every tenant's blocks): a tenant's reads take leases, which check.
        info["directory"] = None
    conn.reply(frame, 0, json.dumps(info).encode())


# -- reads ----------------------------------------------------------------------------------
def _lease(store, key) -> tuple[int, object]:
    """(status, Lease or None) for one parsed key."""
    if type(key) is int:
        return key, None
    try:
        lease = store.lease(key)
    except KVStoreError as exc:
        return status_of(exc), None
    if lease is not None:
        return OK, lease
    return (Status.NOT_IN_DRAM if store.exists(key) else NOT_FOUND), None


def op_get(conn: "Connection", frame: "Frame") -> None:
    """Reply table of (status, size, checksum), then the hits' bytes straight from the arena.

    Items past the reply budget (max_frame_bytes) are answered FRAME_TOO_LARGE
    (not sent; ask again); the first hit is always sent.
    """
    entries = conn.read_table(frame, KEY_HEAD)
    store = conn.store
    table = bytearray(frame.count * GET_ITEM.size)
    parts, leases = [table], []
    budget = conn.max_frame_bytes - len(table)
    try:
        for i, (key, _) in enumerate(entries):
            status, lease = _lease(store, key)
            data, checksum = None, 0
            if lease is not None:
                leases.append(lease)
                data, checksum = lease.view, lease.checksum
            elif status == Status.NOT_IN_DRAM:  # on SSD and DRAM too full to promote: copy it out
                data = store.get(key)
                status = NOT_FOUND if data is None else OK
                checksum = 0 if data is None else _checksum(data)
            size = 0 if data is None else len(data)
            if data is not None and size > budget and len(parts) > 1:
                status, size, checksum = Status.FRAME_TOO_LARGE, 0, 0
            elif data is not None:
                parts.append(data)
                budget -= size
            GET_ITEM.pack_into(table, i * GET_ITEM.size, status, size, checksum)
        conn.reply(frame, frame.count, *parts)
    finally:
        for lease in leases:
            lease.release()


def op_get_ranges(conn: "Connection", frame: "Frame") -> None:
    """Slices of sliced values (``kvstore_client.slices``): a reply table of (status, bytes of
    the range), then for each hit its slices' checksums and lengths and the range's bytes,
    from the arena. Only each value's header is hashed here, against the value's checksum;
    the reader checks each slice. A value that is not sliced, or has fewer slices, is
    INVALID_VALUE; items past the reply budget FRAME_TOO_LARGE, as in GET."""
    entries = conn.read_table(frame, RANGE_ENTRY)
    store = conn.store
    table = bytearray(frame.count * RANGE_ITEM.size)
    parts, leases = [table], []
    budget = conn.max_frame_bytes - len(table)
    try:
        for i, (key, (_, _, first, count)) in enumerate(entries):
            status, lease = _lease(store, key)
            size, sliced = 0, None
            if lease is not None:
                leases.append(lease)
                source = lease.view
                sliced = table_of(source, lease.checksum)
                if sliced is None:
                    status = _not_sliced(store, key)
            elif status == Status.NOT_IN_DRAM:  # on SSD and DRAM too full to promote: read it whole
                data = store.get(key)
                source = memoryview(data) if data is not None else None
                sliced = None if data is None else parse_header(source)
                status = NOT_FOUND if data is None else (OK if sliced is not None else Status.INVALID_VALUE)
            if sliced is not None:
                if not (count and first + count <= sliced.count):
                    status = Status.INVALID_VALUE
                else:
                    offset, size = sliced.span(first, count)
                    cost = size + 12 * count
                    if cost > budget and len(parts) > 1:
                        status, size = Status.FRAME_TOO_LARGE, 0
                    else:
                        parts += (range_preamble(sliced, first, count), source[offset : offset + size])
                        budget -= cost
            RANGE_ITEM.pack_into(table, i * RANGE_ITEM.size, status, size)
        conn.reply(frame, frame.count, *parts)
    finally:
        for lease in leases:
            lease.release()


def _not_sliced(store, key) -> int:
    """The status of a stored value whose header does not say it is sliced: INVALID_VALUE when
    it is intact (a plain value), NOT_FOUND when it is damaged (checked whole, and dropped)."""
    return Status.INVALID_VALUE if store.check(key) else NOT_FOUND


def op_lease(conn: "Connection", frame: "Frame") -> None:
    """Lease DRAM blocks for a same-host reader: u64 lease id, then (status, offset, size, checksum)."""
    entries = conn.read_table(frame, KEY_HEAD)
    store = conn.store
    table = bytearray(U64.size + frame.count * LEASE_ITEM.size)
    group, budget = [], conn.max_frame_bytes
    try:
        for i, (key, _) in enumerate(entries):
            status, lease = _lease(store, key)
            offset = size = checksum = 0
            if lease is not None:
                if lease.size > budget and group:
                    lease.release()
                    status = Status.FRAME_TOO_LARGE
                else:
                    group.append(lease)
                    budget -= lease.size
                    offset, size, checksum = lease.offset, lease.size, lease.checksum
            LEASE_ITEM.pack_into(table, U64.size + i * LEASE_ITEM.size, status, offset, size, checksum)
    except BaseException:
        for lease in group:
            lease.release()
        raise
    lease_id = 0
    if group:
        lease_id = conn.new_id()
        conn.leases.add(lease_id, group, hold=bool(frame.flags & FLAG_HOLD))
    U64.pack_into(table, 0, lease_id)
    conn.reply(frame, frame.count, table)


def op_release(conn: "Connection", frame: "Frame") -> None:
    if frame.body_len != U64.size * frame.count:
        raise _bad(f"RELEASE of {frame.count} lease ids needs {U64.size * frame.count} body bytes")
    ids = struct.unpack(f"<{frame.count}Q", conn.reader.read(frame.body_len))
    groups, missing = conn.leases.pop(ids)
    release_groups(groups)
    unknown = [i for i in missing if not conn.issued(i)]  # the others expired (or were released twice)
    if unknown:
        raise ProtocolError(f"unknown lease id(s) {unknown[:8]}", Status.UNKNOWN_LEASE)
    if not frame.flags & FLAG_NO_REPLY:
        conn.reply(frame, 0)


def _statuses(conn: "Connection", frame: "Frame", fn) -> None:
    """A keys-only request answered with one status byte per key, from ``fn(key) -> status``."""
    entries = conn.read_table(frame, KEY_HEAD)
    out = bytearray(frame.count)
    for i, (key, _) in enumerate(entries):
        if type(key) is int:
            out[i] = key
            continue
        try:
            out[i] = fn(key)
        except KVStoreError as exc:
            out[i] = status_of(exc)
    conn.reply(frame, frame.count, out)


def op_touch(conn: "Connection", frame: "Frame") -> None:
    """Hits a same-host client served itself from the block directory (see kvstore_client.directory);
    malformed keys and keys of undeclared namespaces are skipped."""
    entries = conn.read_table(frame, KEY_HEAD)
    store = conn.store
    conn.store.touch([key for key, _ in entries if type(key) is not int and _known(store, key) == OK])
    if not frame.flags & FLAG_NO_REPLY:
        conn.reply(frame, 0)


def op_verify(conn: "Connection", frame: "Frame") -> None:
    """Check blocks a reader got damaged: OK intact (damaged on the way), CHECKSUM_MISMATCH
    damaged here too and dropped (it reads as a miss from now on), NOT_FOUND."""
    check = conn.store.check
    _statuses(conn, frame, lambda key: _CHECKED[check(key)])


_CHECKED = {True: OK, False: Status.CHECKSUM_MISMATCH, None: NOT_FOUND}


def op_exists(conn: "Connection", frame: "Frame") -> None:
    exists = conn.store.exists
    _statuses(conn, frame, lambda key: OK if exists(key) else NOT_FOUND)


def op_remove(conn: "Connection", frame: "Frame") -> None:
    remove = conn.store.remove
    _statuses(conn, frame, lambda key: OK if remove(key) else NOT_FOUND)


# -- writes -------------------------------------------------------------------------------------
def _known(store, key) -> int:
    """OK, or the status of a well-formed key the store refuses (UNKNOWN_NAMESPACE)."""
    try:
        store.check_key(key)
    except KVStoreError as exc:
        return status_of(exc)
    return OK


def _read_put_table(conn: "Connection", frame: "Frame", trailer: int = 0) -> list[tuple]:
    """Entries (key or status, depth, size, checksum), read one at a time as they arrive;
    checks they, their payloads and a ``trailer`` of that many bytes fill body_len."""
    reader, limit, used, total, entries = conn.reader, frame.body_len, 0, 0, []
    for _ in range(frame.count):
        used += PUT_ENTRY.size
        if used > limit:
            raise _bad("PUT table runs past body_len")
        conn.check_table(used)
        ns_len, dg_len, depth, size, checksum = PUT_ENTRY.unpack(reader.read(PUT_ENTRY.size))
        used += ns_len + dg_len
        if used > limit:
            raise _bad("PUT key entry runs past body_len")
        raw = bytes(reader.read(ns_len + dg_len))
        entries.append((conn.admitted(decode_key(raw[:ns_len], raw[ns_len:])), depth, size, checksum))
        total += size
    if used + total + trailer != limit:
        raise _bad(f"PUT body_len {limit} != table {used} + payloads {total} + checksums {trailer} bytes")
    return entries


def _receive_block(conn: "Connection", key, depth: int, size: int):
    """Receive one PUT payload straight into a reservation, hashing it as it lands (still in
    cache): (the reservation, still to be committed, and the XXH3-64 of its bytes). A refused
    item's payload is drained and its status returned instead."""
    if type(key) is int:
        conn.reader.skip(size)
        return key
    try:
        res = conn.store.reserve(key, size, depth=depth)  # charged to the namespace's quotas
    except KVStoreError as exc:
        conn.reader.skip(size)
        return status_of(exc)
    hasher = ValueHasher(size)
    try:
        conn.reader.readinto(res.buffer, hasher)
    except BaseException:
        res.revoke()  # truncated frame or dead client: nothing half-written becomes visible
        raise
    return res, hasher.intdigest() if hasher.intact else None  # a sliced value must match its table


def _committed(received: tuple, checksum: int) -> int:
    """Publish a received block whose bytes hash to the writer's ``checksum`` (without reading
    them again); revoke it when they do not, or when it is a sliced value whose slices do not
    match its table (CHECKSUM_MISMATCH)."""
    res, digest = received
    if digest != checksum:
        res.revoke()
        return Status.CHECKSUM_MISMATCH
    try:
        res.commit_written(checksum)
    except KVStoreError as exc:
        return status_of(exc)
    return OK


def op_put(conn: "Connection", frame: "Frame") -> None:
    """Each item committed as soon as its payload is in (checked against the table's checksum);
    with CHECKSUMS_LAST the checksums follow the payloads (``_put_checksums_last``)."""
    if frame.flags & FLAG_CHECKSUMS_LAST:
        return _put_checksums_last(conn, frame)
    out = bytearray(frame.count)
    for i, (key, depth, size, checksum) in enumerate(_read_put_table(conn, frame)):
        got = _receive_block(conn, key, depth, size)
        out[i] = got if isinstance(got, int) else _committed(got, checksum)
    conn.reply(frame, frame.count, out)


def _put_checksums_last(conn: "Connection", frame: "Frame") -> None:
    """PUT whose writer sends each checksum after the payloads, hashing its bytes while they
    travel. Each payload is hashed here as it lands, held unpublished until the checksums
    arrive, then committed if they agree (else CHECKSUM_MISMATCH) or all revoked if the frame
    is cut off."""
    trailer = U64.size * frame.count
    held: list = []
    try:
        for key, depth, size, _ in _read_put_table(conn, frame, trailer):
            held.append(_receive_block(conn, key, depth, size))
        expected = struct.unpack(f"<{frame.count}Q", conn.reader.read(trailer))
    except BaseException:
        for item in held:
            if not isinstance(item, int):
                item[0].revoke()
        raise
    out = bytearray(frame.count)
    for i, (item, checksum) in enumerate(zip(held, expected)):
        out[i] = item if isinstance(item, int) else _committed(item, checksum)
    conn.reply(frame, frame.count, out)


def op_reserve(conn: "Connection", frame: "Frame") -> None:
    """Reserve arena space for a same-host writer: u64 reservation id, then (status, offset).
    The space counts against the store's cap on grants until COMMIT binds it to its key
    (a client that reserves and never commits must not crowd blocks out).
    With REGRANT the space is a grant, bound to no key (a STORE names them): a writer that
    sends puts without waiting for their replies keeps a second grant this way."""
    store = conn.store
    entries = conn.read_table(frame, RESERVE_ENTRY)
    if frame.flags & FLAG_REGRANT:
        wanted = [(OK, size, None) for _, (_, _, _, size) in entries]
    else:
        wanted = [
            (key if type(key) is int else _known(store, key) or OK, size, (key, depth))
            for key, (_, _, depth, size) in entries
        ]
    conn.reply(frame, frame.count, _reserved_table(conn, wanted))


def _reserved_table(conn: "Connection", wanted: list[tuple]) -> bytearray:
    """Reserve for each ``(status, size, binding)`` whose status is OK, the items of one frame
    up to ``max_frame_bytes`` in all (FRAME_TOO_LARGE past it), and keep the group on the
    connection: u64 id, then (status, offset) each."""
    table = bytearray(U64.size + len(wanted) * RESERVED_ITEM.size)
    group, budget = [], conn.max_frame_bytes
    try:
        for i, (status, size, binding) in enumerate(wanted):
            res, borrowed = None, 0
            if status == OK and size > budget:
                status = Status.FRAME_TOO_LARGE
            elif status == OK:
                try:
                    res, borrowed = _reserve(conn, size, binding)
                    budget -= size
                except KVStoreError as exc:
                    status = status_of(exc)
            group.append((res, status, binding, borrowed))
            RESERVED_ITEM.pack_into(table, U64.size + i * RESERVED_ITEM.size, status, 0 if res is None else res.offset)
    except BaseException:
        end_group(conn, group)
        raise
    U64.pack_into(table, 0, _register(conn, group, grant=all(item[2] is None for item in group)))
    return table


def _reserve(conn: "Connection", size: int, binding: tuple | None) -> tuple:
    """(Reservation, bytes borrowed from the node-wide allowance): a grant, under the store's
    cap; for a RESERVE item (``binding`` (key, depth)) the cap refuses, a keyed reservation
    on the allowance instead, if it has ``size`` bytes left."""
    store = conn.store
    try:
        res = store.grant(size)
    except CapacityError:
        allowance = conn.server.allowance
        if binding is None or not allowance.take(size):
            raise
        try:
            return store.reserve(binding[0], size, depth=binding[1]), size  # charged to its quotas
        except BaseException:
            allowance.give(size)
            raise
    if binding is not None:  # charged to the namespace's quotas before the writer copies a byte
        try:
            res.charge(binding[0][0])
        except BaseException:
            res.revoke()
            raise
    return res, 0


def op_commit(conn: "Connection", frame: "Frame") -> None:
    """Publish (or with ABORT, revoke) the blocks of one RESERVE, verifying each checksum over
    the arena (with WRITTEN, recording the writer's as STORE does); with REGRANT, also grant
    the same sizes again for the client's next STORE."""
    if frame.body_len != U64.size * (frame.count + 1):
        raise _bad(f"COMMIT of {frame.count} items needs {U64.size * (frame.count + 1)} body bytes")
    reservation_id, *checksums = struct.unpack(f"<{frame.count + 1}Q", conn.reader.read(frame.body_len))
    group = _take_group(conn, reservation_id, frame.count)
    if group is EXPIRED:  # revoked by the housekeeping thread: its writer was too slow
        if not (frame.flags & FLAG_NO_REPLY and frame.flags & FLAG_ABORT):
            conn.reply(frame, frame.count, bytes([Status.EXPIRED]) * frame.count)
        return
    out = bytearray(frame.count)
    try:
        for i, (res, status, binding, _) in enumerate(group):
            if res is None:
                out[i] = status
            elif frame.flags & FLAG_ABORT:
                res.revoke()
            elif binding is None:  # a grant is stored with STORE, which names the keys
                out[i] = Status.INVALID_KEY
            else:
                try:
                    if res.key is None:
                        res.bind(*binding)
                    (res.commit_written if frame.flags & FLAG_WRITTEN else res.commit)(checksums[i])
                except KVStoreError as exc:
                    out[i] = status_of(exc)
    finally:
        end_group(conn, group)  # revokes only what a failure left open
    if frame.flags & FLAG_NO_REPLY and frame.flags & FLAG_ABORT:
        return
    _reply_statuses(conn, frame, out, [item[0].size if item[0] is not None else 0 for item in group])


def op_store(conn: "Connection", frame: "Frame") -> None:
    """Store blocks a same-host writer wrote into granted space: u64 grant id, then one PUT
    entry (key, depth, size, the writer's checksum, taken as is) per granted item."""
    if frame.body_len < U64.size:
        raise _bad("STORE without a grant id")
    grant_id = U64.unpack(conn.reader.read(U64.size))[0]
    entries = conn.read_table(frame, PUT_ENTRY, consumed=U64.size)
    group = _take_group(conn, grant_id, frame.count)
    if group is EXPIRED:  # grants never expire, but a RESERVE's id may be sent here
        raise _bad(f"STORE of reservation {grant_id}, which was a RESERVE's, not a grant")
    out = bytearray(frame.count)
    try:
        for i, ((res, status, _, _), (key, (_, _, depth, size, checksum))) in enumerate(zip(group, entries)):
            if res is None:
                out[i] = status
            elif type(key) is int:
                out[i] = key
            elif size != res.size:
                out[i] = Status.INVALID_VALUE
            else:
                try:
                    res.bind(key, depth)  # charged to the namespace's quotas (QUOTA_EXCEEDED)
                    res.commit_written(checksum)
                except KVStoreError as exc:
                    out[i] = status_of(exc)
    finally:
        end_group(conn, group)
    _reply_statuses(conn, frame, out, [entry[1][3] for entry in entries])


def _take_group(conn: "Connection", group_id: int, count: int):
    """The reservation group (RESERVE or grant) ``group_id`` of this connection, for ``count``
    items; EXPIRED for a keyed group the housekeeping thread revoked (it outlived write_ttl)."""
    group = conn.reservations.pop(group_id)
    if group is None:
        raise ProtocolError(f"unknown reservation id {group_id}", Status.UNKNOWN_LEASE)
    if group is EXPIRED:
        return group
    if len(group) != count:
        end_group(conn, group)
        raise _bad(f"{count} items for a reservation of {len(group)}")
    return group


def _reply_statuses(conn: "Connection", frame: "Frame", statuses: bytearray, sizes: list[int]) -> None:
    """One status byte per item; with REGRANT, then a grant of ``sizes`` (u64 id, RESERVED items)."""
    if not frame.flags & FLAG_REGRANT:
        conn.reply(frame, frame.count, statuses)
        return
    grant = _reserved_table(conn, [(OK, size, None) for size in sizes])
    conn.reply(frame, frame.count, bytes(statuses) + grant)


def _register(conn: "Connection", group: list, grant: bool) -> int:
    """Keep a reservation group on the connection (a grant, or a RESERVE's, which expires
    after write_ttl); its id (0 when nothing was reserved)."""
    if not any(item[0] is not None for item in group):
        return 0
    group_id = conn.new_id()
    conn.reservations.add(group_id, group, grant)
    return group_id


def end_group(conn: "Connection", group: list) -> None:
    """A reservation group is done (published, aborted, failed, or its connection ended):
    revoke what it still holds and give back what it borrowed from the allowance."""
    borrowed = sum(item[3] for item in group)
    try:
        for res, *_ in group:
            if res is not None and res.open:
                res.revoke()
    finally:
        if borrowed:
            conn.server.allowance.give(borrowed)


def op_pull(conn: "Connection", frame: "Frame") -> None:
    """Copy blocks from another node (u8 address length, its data-plane "host:port", then
    PULL entries) into this one: one status byte per item (see kvstore.transport.puller)."""
    if frame.body_len < 1:
        raise _bad("PULL without a source address")
    address_len = conn.reader.read(1)[0]
    if not address_len or 1 + address_len > frame.body_len:
        raise _bad("PULL source address runs past body_len")
    source = bytes(conn.reader.read(address_len)).decode(errors="replace")
    entries = conn.read_table(frame, PULL_ENTRY, consumed=1 + address_len)
    out = bytearray(frame.count)
    wanted = [i for i, (key, _) in enumerate(entries) if type(key) is not int]
    for i, (key, _) in enumerate(entries):
        if type(key) is int:
            out[i] = key
    if wanted:
        statuses = conn.server.puller.pull(source, [entries[i][0] for i in wanted], [entries[i][1][2] for i in wanted])
        for i, status in zip(wanted, statuses):
            out[i] = status
    conn.reply(frame, frame.count, out)


def _one_request(op):
    """Run ``op`` as one store request (BlockStore.request): the blocks a frame writes are
    not evicted to make room for the rest of that frame."""

    def serve(conn: "Connection", frame: "Frame") -> None:
        with conn.store.request():
            op(conn, frame)

    serve.__name__ = serve.__qualname__ = op.__name__
    serve.__doc__ = op.__doc__
    return serve


OPS = {
    Op.PING: op_ping,
    Op.INFO: op_info,
    Op.GET: op_get,
    Op.PUT: _one_request(op_put),
    Op.EXISTS: op_exists,
    Op.REMOVE: op_remove,
    Op.LEASE: op_lease,
    Op.RELEASE: op_release,
    Op.RESERVE: op_reserve,
    Op.COMMIT: _one_request(op_commit),
    Op.TOUCH: op_touch,
    Op.PULL: _one_request(op_pull),
    Op.STORE: _one_request(op_store),
    Op.VERIFY: op_verify,
    Op.AUTH: op_auth,
    Op.GET_RANGES: op_get_ranges,
}
