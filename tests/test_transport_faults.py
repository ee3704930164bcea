"""The data-plane server under hostile and broken clients, over raw sockets.

Every test ends by checking that a fresh client is still served correctly
(the ``healthy_after`` fixture), and that the faulty connection left no
lease, reservation or DRAM behind where that applies.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time

import pytest
import xxhash

from kvstore.node.config import StoreConfig
from kvstore.node.store import BlockStore
from kvstore.transport.server import DataPlaneServer
from kvstore_client.errors import ChecksumMismatch, ProtocolError, TransportError
from kvstore_client.transport import ShmConnection, TcpConnection, UnixConnection
from kvstore_client.wire import (
    FLAG_ABORT,
    FLAG_NO_REPLY,
    FLAG_REGRANT,
    FLAG_CHECKSUMS_LAST,
    FLAG_WRITTEN,
    GET_ITEM,
    HEADER,
    LEASE_ITEM,
    MAX_ITEMS,
    PIECEWISE_FROM,
    RESERVED_ITEM,
    SPIN_BACKOFF,
    U64,
    FrameReader,
    Op,
    Status,
    key_entry,
    pack_header,
    put_entry,
    reply_spin,
)
from tests.conftest import run_in_threads
from tests.processes import recv_exact

KiB, MiB = 1 << 10, 1 << 20
MAX_BLOCK = 2 * MiB


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    store = BlockStore(
        StoreConfig(dram_capacity=32 * MiB, ssd_path=str(tmp / "ssd"), ssd_capacity=64 * MiB, max_block_bytes=MAX_BLOCK)
    )
    server = DataPlaneServer(store, unix_path=str(tmp / "dp.sock"), max_frame_bytes=8 * MiB).start()
    yield server
    server.stop()
    store.close()


@pytest.fixture(autouse=True)
def healthy_after(server):
    yield
    with TcpConnection(server.address) as conn:
        key = ("ns", b"health-check")
        conn.put(key, b"still serving")
        assert conn.get(key) == b"still serving"


def raw(server) -> socket.socket:
    sock = socket.create_connection(server.address.rsplit(":", 1))
    sock.settimeout(5)
    return sock


def same_host(server) -> socket.socket:
    """A raw connection through the node's Unix socket: RESERVE, COMMIT, STORE and LEASE are
    served only there (over TCP: SAME_HOST_ONLY)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(server.unix_path)
    return sock


def read_reply(sock: socket.socket) -> tuple[int, int, int, int, bytes]:
    """(op, status, request_id, count, body) of the next reply frame."""
    magic, version, op, status, flags, request_id, count, body_len = HEADER.unpack(recv_exact(sock, HEADER.size))
    assert magic == b"KV" and version == 1
    return op, status, request_id, count, recv_exact(sock, body_len)


def expect_error_and_close(sock: socket.socket, status: int) -> str:
    op, got, _, _, body = read_reply(sock)
    assert (op, got) == (Op.ERROR, status), body
    assert sock.recv(1) == b""  # the node closed the connection
    return body.decode()


def wait_until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def no_connections(server) -> bool:
    return server.connections == 0


def key(name: str) -> tuple[str, bytes]:
    return ("ns", xxhash.xxh3_128_digest(name.encode()))


def keys_frame(op: int, keys: list, request_id: int = 1, flags: int = 0) -> bytes:
    table = b"".join(key_entry(k) for k in keys)
    return pack_header(op, request_id, len(keys), len(table), flags=flags) + table


# -- malformed frames ---------------------------------------------------------------------
def test_garbage_bytes(server):
    with raw(server) as sock:
        sock.sendall(b"GET /index.html HTTP/1.1\r\nHost: x\r\n\r\n")
        assert "magic" in expect_error_and_close(sock, Status.BAD_FRAME)


def test_bad_magic(server):
    with raw(server) as sock:
        sock.sendall(b"XY" + pack_header(Op.PING, 7, 0, 0)[2:])
        expect_error_and_close(sock, Status.BAD_FRAME)


def test_wrong_version(server):
    with raw(server) as sock:
        sock.sendall(HEADER.pack(b"KV", 2, Op.PING, 0, 0, 9, 0, 0))
        assert "version" in expect_error_and_close(sock, Status.UNSUPPORTED)


def test_unknown_op(server):
    with raw(server) as sock:
        sock.sendall(pack_header(99, 3, 0, 0))
        assert "unknown op" in expect_error_and_close(sock, Status.UNSUPPORTED)


def test_huge_body_len_and_count(server):
    with raw(server) as sock:
        sock.sendall(pack_header(Op.PUT, 1, 1, 1 << 40))
        expect_error_and_close(sock, Status.FRAME_TOO_LARGE)
    with raw(server) as sock:  # the error reply survives the client still sending its body
        sock.sendall(pack_header(Op.PUT, 1, 1, 9 * MiB) + bytes(4 * MiB))
        expect_error_and_close(sock, Status.FRAME_TOO_LARGE)
    with raw(server) as sock:
        sock.sendall(pack_header(Op.GET, 1, MAX_ITEMS + 1, 64))
        expect_error_and_close(sock, Status.FRAME_TOO_LARGE)


def test_table_inconsistent_with_body_len(server):
    entry = key_entry(key("a"))
    with raw(server) as sock:  # count says 2, body holds one entry
        sock.sendall(pack_header(Op.GET, 1, 2, len(entry)) + entry)
        expect_error_and_close(sock, Status.BAD_FRAME)
    with raw(server) as sock:  # a key entry whose lengths run past the body
        sock.sendall(pack_header(Op.EXISTS, 1, 1, 4) + bytes([2, 60]) + b"ns")
        expect_error_and_close(sock, Status.BAD_FRAME)
    with raw(server) as sock:  # PUT payload sizes that do not add up to body_len
        table = put_entry(key("b"), 0, 10, 0)
        sock.sendall(pack_header(Op.PUT, 1, 1, len(table) + 4) + table + b"abcd")
        expect_error_and_close(sock, Status.BAD_FRAME)


def test_unknown_lease_and_reservation_ids(server):
    with raw(server) as sock:
        sock.sendall(pack_header(Op.RELEASE, 1, 1, 8, flags=FLAG_NO_REPLY) + U64.pack(12345))
        expect_error_and_close(sock, Status.UNKNOWN_LEASE)
    with same_host(server) as sock:
        sock.sendall(pack_header(Op.COMMIT, 1, 1, 16) + U64.pack(777) + U64.pack(0))
        expect_error_and_close(sock, Status.UNKNOWN_LEASE)


# -- broken clients -------------------------------------------------------------------------
def test_truncated_frame_then_close(server):
    with raw(server) as sock:
        sock.sendall(pack_header(Op.GET, 1, 3, 100) + b"\x02\x10ns")
    wait_until(lambda: no_connections(server))


def test_client_killed_mid_put_stores_nothing(server):
    store = server.store
    wait_until(lambda: no_connections(server))
    used = store.stats()["dram"]["used"]
    first, second = key("mid-put-1"), key("mid-put-2")
    payload = bytes(range(256)) * (4 * KiB)  # 1 MiB
    checksum = xxhash.xxh3_64_intdigest(payload)
    table = put_entry(first, 0, len(payload), checksum)
    with raw(server) as sock:  # one block, cut off halfway
        sock.sendall(pack_header(Op.PUT, 1, 1, len(table) + len(payload)) + table + payload[: len(payload) // 2])
        wait_until(lambda: store.stats()["dram"]["used"] > used)  # the node is receiving into a reservation
    wait_until(lambda: no_connections(server))
    assert not store.exists(first) and store.stats()["dram"]["used"] == used
    table += put_entry(second, 1, len(payload), checksum)
    with raw(server) as sock:
        sock.sendall(pack_header(Op.PUT, 1, 2, len(table) + 2 * len(payload)) + table)
        sock.sendall(payload)  # the first block arrives whole: it is committed
        sock.sendall(payload[: len(payload) // 2])  # the second is cut off
        wait_until(lambda: store.exists(first))
    wait_until(lambda: no_connections(server))
    assert store.get(first) == payload and not store.exists(second)
    store.remove(first)
    assert store.stats()["dram"]["used"] == used


def test_reservations_and_leases_end_with_the_connection(server):
    store = server.store
    stored = key("leased-then-dropped")
    store.put(stored, b"v" * 5000)
    wait_until(lambda: no_connections(server))
    used = store.stats()["dram"]["used"]
    entry = struct.pack("<BBIQ", 2, 16, 0, MiB) + b"ns" + key("reserved")[1]
    with same_host(server) as sock:
        sock.sendall(pack_header(Op.RESERVE, 1, 1, len(entry)) + entry)
        _, status, _, _, body = read_reply(sock)
        assert status == Status.OK and U64.unpack_from(body)[0] != 0 and body[8] == Status.OK
        sock.sendall(keys_frame(Op.LEASE, [stored], request_id=2))
        _, status, _, _, body = read_reply(sock)
        assert LEASE_ITEM.unpack_from(body, 8)[0] == Status.OK
        assert store.dram.is_leased(stored) and store.stats()["dram"]["used"] > used
    wait_until(lambda: no_connections(server))
    assert not store.dram.is_leased(stored) and not store.exists(key("reserved"))
    assert store.stats()["dram"]["used"] == used


def test_commit_abort_revokes_and_count_mismatch_is_a_bad_frame(server):
    store = server.store
    wait_until(lambda: no_connections(server))
    used = store.stats()["dram"]["used"]
    target = key("aborted")
    table = struct.pack("<BBIQ", 2, 16, 0, 64 * KiB) + b"ns" + target[1] + struct.pack("<BBIQ", 2, 0, 0, 10) + b"ns"
    with same_host(server) as sock:
        for request_id in (1, 3):
            sock.sendall(pack_header(Op.RESERVE, request_id, 2, len(table)) + table)
            _, status, _, _, body = read_reply(sock)
            assert status == Status.OK and (body[8], body[17]) == (Status.OK, Status.INVALID_KEY)
            reservation = U64.unpack_from(body)[0]
            if request_id == 1:
                sock.sendall(pack_header(Op.COMMIT, 2, 2, 24, flags=FLAG_ABORT) + U64.pack(reservation) + bytes(16))
                assert read_reply(sock)[4] == bytes([Status.OK, Status.INVALID_KEY])
        sock.sendall(pack_header(Op.COMMIT, 4, 1, 16) + U64.pack(reservation) + bytes(8))  # 1 checksum for 2 items
        expect_error_and_close(sock, Status.BAD_FRAME)
    wait_until(lambda: no_connections(server))
    assert not store.exists(target) and store.stats()["dram"]["used"] == used


def regrant_reply(body: bytes, count: int) -> tuple[list[int], int, list[tuple[int, int]]]:
    """(statuses, grant id, [(status, offset)]) of a COMMIT or STORE reply sent with REGRANT."""
    grant = U64.unpack_from(body, count)[0]
    return list(body[:count]), grant, list(RESERVED_ITEM.iter_unpack(body[count + 8 :]))


def grant_by_aborting(sock, k, size: int) -> tuple[int, int, list[tuple[int, int]]]:
    """RESERVE one block, then COMMIT it with ABORT and REGRANT: (reservation id, grant id, granted items)."""
    entry = struct.pack("<BBIQ", 2, 16, 0, size) + b"ns" + k[1]
    sock.sendall(pack_header(Op.RESERVE, 1, 1, len(entry)) + entry)
    reservation = U64.unpack_from(read_reply(sock)[4])[0]
    sock.sendall(pack_header(Op.COMMIT, 2, 1, 16, flags=FLAG_ABORT | FLAG_REGRANT) + U64.pack(reservation) + bytes(8))
    _, grant, granted = regrant_reply(read_reply(sock)[4], 1)
    return reservation, grant, granted


def test_grants_store_named_blocks_and_refuse_mismatches(server):
    store = server.store
    wait_until(lambda: no_connections(server))
    used = store.stats()["dram"]["used"]
    first, second, third = key("granted-1"), key("granted-2"), key("granted-3")
    value = b"g" * (64 * KiB)
    entry = struct.pack("<BBIQ", 2, 16, 3, len(value)) + b"ns" + first[1]
    with same_host(server) as sock:
        sock.sendall(pack_header(Op.RESERVE, 1, 1, len(entry)) + entry)
        reservation = U64.unpack_from(read_reply(sock)[4])[0]
        checksum = xxhash.xxh3_64_intdigest(value)
        sock.sendall(pack_header(Op.COMMIT, 2, 1, 16, flags=FLAG_REGRANT) + U64.pack(reservation) + U64.pack(checksum))
        statuses, grant, granted = regrant_reply(read_reply(sock)[4], 1)
        assert statuses == [Status.CHECKSUM_MISMATCH]  # nothing was written into the reservation
        assert grant and granted[0][0] == Status.OK
        offset = granted[0][1]
        store.dram.arena.view[offset : offset + len(value)] = value  # what a same-host writer does through its mapping
        body = U64.pack(grant) + put_entry(second, 7, len(value), checksum)  # the writer's checksum, taken as is
        sock.sendall(pack_header(Op.STORE, 3, 1, len(body), flags=FLAG_REGRANT) + body)
        statuses, grant, granted = regrant_reply(read_reply(sock)[4], 1)
        assert statuses == [Status.OK] and store.get(second) == value and store.describe(second).depth == 7
        with TcpConnection(server.address) as reader:
            assert reader.get(second) == value
        body = U64.pack(grant) + put_entry(third, 0, len(value) - 1, 0)  # not the granted size
        sock.sendall(pack_header(Op.STORE, 4, 1, len(body)) + body)
        assert read_reply(sock)[4] == bytes([Status.INVALID_VALUE])
        sock.sendall(pack_header(Op.COMMIT, 5, 1, 16, flags=FLAG_REGRANT) + U64.pack(grant) + bytes(8))
        expect_error_and_close(sock, Status.UNKNOWN_LEASE)  # that grant is gone: a STORE consumes it
    wait_until(lambda: no_connections(server))
    assert not store.exists(first) and not store.exists(third)
    store.remove(second)
    assert store.stats()["dram"]["used"] == used  # grants left open ended with the connection


def test_reserve_with_regrant_makes_a_grant_that_a_store_names(server):
    """RESERVE with REGRANT sets space aside bound to no key (the keys in its entries are
    ignored): only a STORE publishes it, under the keys the STORE names."""
    store = server.store
    wait_until(lambda: no_connections(server))
    used = store.stats()["dram"]["used"]
    ignored, first, second = key("regrant-ignored"), key("regrant-1"), key("regrant-2")
    values = [b"a" * (16 * KiB), b"b" * (32 * KiB)]
    entries = b"".join(struct.pack("<BBIQ", 2, 16, 0, len(v)) + b"ns" + ignored[1] for v in values)
    with same_host(server) as sock:
        sock.sendall(pack_header(Op.RESERVE, 1, 2, len(entries), flags=FLAG_REGRANT) + entries)
        body = read_reply(sock)[4]
        grant = U64.unpack_from(body)[0]
        granted = list(RESERVED_ITEM.iter_unpack(body[U64.size :]))
        assert grant and [status for status, _ in granted] == [Status.OK, Status.OK]
        assert store.stats()["dram"]["used"] == used + 16 * KiB + 32 * KiB and not store.exists(ignored)
        for (_, offset), v in zip(granted, values):
            store.dram.arena.view[offset : offset + len(v)] = v
        table = U64.pack(grant) + b"".join(
            put_entry(k, 0, len(v), xxhash.xxh3_64_intdigest(v)) for k, v in zip((first, second), values)
        )
        sock.sendall(pack_header(Op.STORE, 2, 2, len(table)) + table)
        assert read_reply(sock)[4] == bytes([Status.OK, Status.OK])
        assert [store.get(first), store.get(second)] == values and not store.exists(ignored)
    for k in (first, second):
        store.remove(k)
    wait_until(lambda: no_connections(server))
    assert store.stats()["dram"]["used"] == used


def test_a_stored_block_that_does_not_match_its_checksum_is_never_served(server):
    """STORE takes the writer's checksum without reading the bytes: if they changed under the
    writer's copy, the first verifying reader refuses them, the node confirms (VERIFY) and
    drops the block, and it reads as a miss from then on."""
    k, value = key("torn-store"), b"t" * 4096
    with same_host(server) as sock:
        _, grant, granted = grant_by_aborting(sock, key("first-of-size"), len(value))
        offset = granted[0][1]
        server.store.dram.arena.view[offset : offset + len(value)] = value
        body = U64.pack(grant) + put_entry(k, 0, len(value), xxhash.xxh3_64_intdigest(b"u" * 4096))
        sock.sendall(pack_header(Op.STORE, 3, 1, len(body)) + body)
        assert read_reply(sock)[4] == bytes([Status.OK])
    failures = server.store.stats()["dram"]["checksum_failures"]
    with ShmConnection(server.unix_path) as shm:
        assert shm.read_direct([k]) == [None]  # the one-sided read refuses it
        assert shm.get(k) is None  # then the node finds it damaged too, and drops it
    assert not server.store.exists(k)
    assert server.store.stats()["dram"]["checksum_failures"] == failures + 1


def test_a_commit_of_written_blocks_records_the_writers_checksum_and_readers_check_it(server):
    """COMMIT with WRITTEN, like STORE, takes the writer's checksums as they are: a block whose
    bytes do not match is stored, refused by the first verifying reader and dropped."""
    good, torn, value = key("written-good"), key("written-torn"), b"w" * 4096
    entries = b"".join(struct.pack("<BBIQ", 2, 16, 0, len(value)) + b"ns" + k[1] for k in (good, torn))
    with same_host(server) as sock:
        sock.sendall(pack_header(Op.RESERVE, 1, 2, len(entries)) + entries)
        body = read_reply(sock)[4]
        reservation, items = U64.unpack_from(body)[0], list(RESERVED_ITEM.iter_unpack(body[8:]))
        for _, offset in items:
            server.store.dram.arena.view[offset : offset + len(value)] = value
        checksums = U64.pack(xxhash.xxh3_64_intdigest(value)) + U64.pack(xxhash.xxh3_64_intdigest(b"x" * 4096))
        sock.sendall(pack_header(Op.COMMIT, 2, 2, 24, flags=FLAG_WRITTEN) + U64.pack(reservation) + checksums)
        assert read_reply(sock)[4] == bytes([Status.OK, Status.OK])  # recorded, not re-read
    with ShmConnection(server.unix_path) as shm:
        assert shm.get(good) == value
        assert shm.get(torn) is None  # refused, confirmed damaged by the node (VERIFY), dropped
    assert server.store.exists(good) and not server.store.exists(torn)
    server.store.remove(good)


def test_a_grant_cannot_be_committed_without_keys_and_abort_needs_no_reply(server):
    store = server.store
    wait_until(lambda: no_connections(server))
    used = store.stats()["dram"]["used"]
    value = b"a" * 4096
    entry = struct.pack("<BBIQ", 2, 16, 0, len(value)) + b"ns" + key("to-abort")[1]
    with same_host(server) as sock:
        reservation, grant, _ = grant_by_aborting(sock, key("to-abort"), len(value))
        sock.sendall(pack_header(Op.COMMIT, 3, 1, 16) + U64.pack(grant) + bytes(8))  # a grant names no key
        assert read_reply(sock)[4] == bytes([Status.INVALID_KEY])
        sock.sendall(
            pack_header(Op.COMMIT, 4, 1, 16, flags=FLAG_ABORT | FLAG_REGRANT) + U64.pack(reservation) + bytes(8)
        )
        expect_error_and_close(sock, Status.UNKNOWN_LEASE)
    wait_until(lambda: no_connections(server))
    assert store.stats()["dram"]["used"] == used
    with same_host(server) as sock:  # ABORT with NO_REPLY: the next reply is the PING's
        sock.sendall(pack_header(Op.RESERVE, 1, 1, len(entry)) + entry)
        reservation = U64.unpack_from(read_reply(sock)[4])[0]
        sock.sendall(
            pack_header(Op.COMMIT, 2, 1, 16, flags=FLAG_ABORT | FLAG_NO_REPLY)
            + U64.pack(reservation)
            + bytes(8)
            + pack_header(Op.PING, 3, 0, 0)
        )
        assert read_reply(sock)[:3] == (Op.PING, Status.OK, 3)
        assert store.stats()["dram"]["used"] == used


def test_refused_items_are_drained_and_the_stream_stays_in_sync(server):
    big, empty, ok = key("too-big"), key("empty"), key("fine")
    payloads = [b"x" * (MAX_BLOCK + 1), b"", b"fine"]
    table = b"".join(put_entry(k, 0, len(p), xxhash.xxh3_64_intdigest(p)) for k, p in zip([big, empty, ok], payloads))
    bad_sum = put_entry(key("damaged"), 0, 4, 12345)
    with raw(server) as sock:
        sock.sendall(pack_header(Op.PUT, 1, 3, len(table) + sum(map(len, payloads))) + table + b"".join(payloads))
        sock.sendall(pack_header(Op.PUT, 2, 1, len(bad_sum) + 4) + bad_sum + b"abcd")
        sock.sendall(pack_header(Op.PING, 3, 0, 0))
        assert read_reply(sock) == (Op.PUT, Status.OK, 1, 3, bytes([Status.INVALID_VALUE, Status.INVALID_VALUE, 0]))
        assert read_reply(sock) == (Op.PUT, Status.OK, 2, 1, bytes([Status.CHECKSUM_MISMATCH]))
        assert read_reply(sock)[:3] == (Op.PING, Status.OK, 3)
    assert server.store.get(ok) == b"fine" and not server.store.exists(big) and not server.store.exists(key("damaged"))


def test_a_large_put_is_checked_to_its_last_byte(server):
    """A payload received in pieces (PIECEWISE_FROM bytes or more) and hashed as they land:
    one whose last byte differs from what the checksum was made of is not stored."""
    good = os.urandom(MAX_BLOCK)
    damaged = good[:-1] + bytes([good[-1] ^ 1])
    keys = [key("large-good"), key("large-damaged")]
    table = b"".join(put_entry(k, 0, MAX_BLOCK, xxhash.xxh3_64_intdigest(good)) for k in keys)
    with raw(server) as sock:
        sock.sendall(pack_header(Op.PUT, 1, 2, len(table) + 2 * MAX_BLOCK) + table + good + damaged)
        assert read_reply(sock) == (Op.PUT, Status.OK, 1, 2, bytes([Status.OK, Status.CHECKSUM_MISMATCH]))
    assert server.store.get(keys[0]) == good and not server.store.exists(keys[1])
    server.store.remove(keys[0])


def test_checksums_after_the_payloads_publish_only_what_they_match(server):
    """PUT with CHECKSUMS_LAST: nothing is visible until the trailing checksums arrive; a
    block whose checksum disagrees is not stored, the others are."""
    store = server.store
    good, bad, big = key("last-good"), key("last-bad"), key("last-too-big")
    payloads = [b"g" * (64 * KiB), b"b" * (64 * KiB), b"x" * (MAX_BLOCK + 1)]
    table = b"".join(put_entry(k, 0, len(p), 0) for k, p in zip((good, bad, big), payloads))
    trailer = b"".join(U64.pack(xxhash.xxh3_64_intdigest(p)) for p in (payloads[0], b"other", payloads[2]))
    body = table + b"".join(payloads)
    with raw(server) as sock:
        sock.sendall(pack_header(Op.PUT, 1, 3, len(body) + len(trailer), flags=FLAG_CHECKSUMS_LAST) + body)
        wait_until(lambda: store.stats()["dram"]["used"] >= 128 * KiB)  # both received (the third refused)...
        assert not store.exists(good) and not store.exists(bad)  # ...and neither published yet
        sock.sendall(trailer)
        assert read_reply(sock) == (
            Op.PUT,
            Status.OK,
            1,
            3,
            bytes([Status.OK, Status.CHECKSUM_MISMATCH, Status.INVALID_VALUE]),
        )
    assert store.get(good) == payloads[0] and not store.exists(bad) and not store.exists(big)
    store.remove(good)


def test_checksums_after_the_payloads_cut_off_or_miscounted_store_nothing(server):
    store = server.store
    wait_until(lambda: no_connections(server))
    used = store.stats()["dram"]["used"]
    k = key("last-cut")
    payload = b"c" * (256 * KiB)
    table = put_entry(k, 0, len(payload), 0)
    with raw(server) as sock:  # the payload whole, the checksum cut in half
        sock.sendall(
            pack_header(Op.PUT, 1, 1, len(table) + len(payload) + 8, flags=FLAG_CHECKSUMS_LAST)
            + table
            + payload
            + U64.pack(xxhash.xxh3_64_intdigest(payload))[:4]
        )
        wait_until(lambda: store.stats()["dram"]["used"] > used)
    wait_until(lambda: no_connections(server))
    assert not store.exists(k) and store.stats()["dram"]["used"] == used
    with raw(server) as sock:  # body_len without room for the checksums: a bad frame
        sock.sendall(pack_header(Op.PUT, 1, 1, len(table) + len(payload), flags=FLAG_CHECKSUMS_LAST) + table)
        assert "checksums 8 bytes" in expect_error_and_close(sock, Status.BAD_FRAME)
    assert not store.exists(k)


def test_pipelined_requests_are_answered_in_order(server):
    k = key("pipelined")
    server.store.put(k, b"pipelined value")
    with raw(server) as sock:
        sock.sendall(
            pack_header(Op.PING, 10, 0, 0)
            + keys_frame(Op.EXISTS, [k, key("nope")], 11)
            + keys_frame(Op.GET, [k], 12)
            + pack_header(Op.PING, 13, 0, 0)
        )
        assert read_reply(sock)[:3] == (Op.PING, Status.OK, 10)
        assert read_reply(sock)[2:] == (11, 2, bytes([Status.OK, Status.NOT_FOUND]))
        op, status, rid, count, body = read_reply(sock)
        assert (op, rid, count) == (Op.GET, 12, 1)
        assert GET_ITEM.unpack_from(body)[:2] == (Status.OK, 15) and body[GET_ITEM.size :] == b"pipelined value"
        assert read_reply(sock)[2] == 13


def test_many_concurrent_clients_get_exact_bytes(server):
    def client(n: int) -> None:
        kind = (TcpConnection, UnixConnection, ShmConnection)[n % 3]
        with kind(server.unix_path if kind is not TcpConnection else server.address) as conn:
            keys = [key(f"client-{n}-{i}") for i in range(8)]
            for round_ in range(40):
                values = [xxhash.xxh3_128_digest(f"{n}/{i}/{round_}".encode()) * (64 * (i + 1)) for i in range(8)]
                assert conn.put_many(list(zip(keys, values))) == [None] * 8
                assert conn.get_many(keys) == values
                assert conn.exists_many(keys[:4]) == [True] * 4

    errors = run_in_threads(client, 16)
    assert not errors, errors[:3]


def test_stop_closes_live_connections(tmp_path):
    with BlockStore(StoreConfig(dram_capacity=8 * MiB, max_block_bytes=MiB)) as store:
        server = DataPlaneServer(store).start()
        conn = TcpConnection(server.address)
        conn.put(key("x"), b"y")
        server.stop()
        assert server.connections == 0
        with pytest.raises(TransportError):
            conn.get(key("x"))
        assert conn.closed


def test_shm_refuses_a_node_on_another_host():
    with BlockStore(StoreConfig(dram_capacity=8 * MiB, max_block_bytes=MiB)) as store:
        with DataPlaneServer(store, machine_id="some-other-host") as elsewhere:
            with pytest.raises(TransportError, match="another host"):
                ShmConnection(elsewhere.address)


class FakeNode:
    """A scripted node: answers INFO properly, then each later request with the next canned reply."""

    def __init__(self, replies: list, hang_up: bool = False):
        self.replies, self.hang_up = replies, hang_up  # hang_up: close right after the last reply
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self.listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        sock, _ = self.listener.accept()
        info = json.dumps({"max_frame_bytes": MiB, "max_block_bytes": 64 * KiB, "max_items": 16}).encode()
        with sock:
            for reply in [lambda op, rid: pack_header(op, rid, 0, len(info), flags=1) + info, *self.replies]:
                _, _, op, _, _, rid, _, body_len = HEADER.unpack(recv_exact(sock, HEADER.size))
                recv_exact(sock, body_len)
                sock.sendall(reply(op, rid))
            if not self.hang_up:
                sock.recv(1)


@pytest.mark.parametrize("size", [1000, PIECEWISE_FROM, 3 * PIECEWISE_FROM + 77])
def test_a_frame_reader_hashes_every_byte_it_receives(size):
    """Part of the payload arrives with the header (buffered), the rest is received, in
    pieces for large ones: the hash covers both, in order."""
    payload = os.urandom(size)
    left, right = socket.socketpair()
    with left, right:
        sender = threading.Thread(target=left.sendall, args=(b"H" * 16 + payload,))
        sender.start()
        reader = FrameReader(right)
        assert bytes(reader.read(16)) == b"H" * 16
        out, hasher = bytearray(size), xxhash.xxh3_64()
        reader.readinto(memoryview(out), hasher)
        sender.join()
    assert out == payload and hasher.intdigest() == xxhash.xxh3_64_intdigest(payload)


def test_a_polling_reader_reads_what_comes_soon_or_late_and_backs_off_after_late():
    """A client's reader polls for a reply before it sleeps in recv: a frame that comes
    in pieces, soon or after the polling ran out, is read whole; one that came late makes
    the next SPIN_BACKOFF reads sleep at once; a hang-up while it polls is a TransportError."""
    left, right = socket.socketpair()
    with left, right:
        reader = FrameReader(right, spin=0.3)  # ample: a busy machine must not turn soon into late

        def send_later(delay: float, data: bytes) -> threading.Thread:
            thread = threading.Thread(target=lambda: (time.sleep(delay), left.sendall(data)))
            thread.start()
            return thread

        sender = send_later(0.005, b"soon")
        assert bytes(reader.read(4, poll=True)) == b"soon" and reader._skip_spins == 0
        sender.join()
        left.sendall(b"ha")
        sender = send_later(0.01, b"lf")
        assert bytes(reader.read(4, poll=True)) == b"half"  # half buffered, half polled for
        sender.join()
        sender = send_later(0.6, b"late")
        assert bytes(reader.read(4, poll=True)) == b"late" and reader._skip_spins == SPIN_BACKOFF
        sender.join()
        left.sendall(b"next")
        assert bytes(reader.read(4, poll=True)) == b"next" and reader._skip_spins == SPIN_BACKOFF - 1
        left.sendall(b"nopoll")
        assert bytes(reader.read(6)) == b"nopoll" and reader._skip_spins == SPIN_BACKOFF - 1  # not a poll
        reader._skip_spins = 0
        left.shutdown(socket.SHUT_WR)
        with pytest.raises(TransportError):
            reader.read(4, poll=True)


def test_servers_never_poll_and_clients_do(tmp_path):
    store = BlockStore(StoreConfig(dram_capacity=MiB, max_block_bytes=64 * KiB))
    with DataPlaneServer(store, unix_path=str(tmp_path / "dp.sock")) as server:
        with UnixConnection(server.unix_path) as conn:
            conn.put(key("k"), b"v")
            (served,) = list(server._connections)
            assert served.reader._spin == 0 and conn._reader._spin == reply_spin() > 0
    store.close()


@pytest.mark.parametrize("size", [800, PIECEWISE_FROM + 4097], ids=["one-recv", "received-in-pieces"])
def test_client_rejects_damaged_bytes_and_broken_replies(size):
    good = os.urandom(size)
    data = good[:-1] + bytes([good[-1] ^ 1])  # the last byte changed on the way
    table = GET_ITEM.pack(Status.OK, len(data), xxhash.xxh3_64_intdigest(good))
    damaged = lambda op, rid: pack_header(op, rid, 1, len(table) + len(data), flags=1) + table + data  # noqa: E731
    seen = []
    node = FakeNode(
        [
            damaged,
            lambda op, rid: (
                seen.append(op) or pack_header(op, rid, 1, 1, flags=1) + bytes([Status.OK])
            ),  # VERIFY: intact
            damaged,  # so it was damaged on the way: read once more, damaged again
            lambda op, rid: pack_header(op, rid, 0, 0, flags=1),
            lambda op, rid: pack_header(op, rid + 1, 0, 0, flags=1),  # answers the wrong request
        ]
    )
    conn = TcpConnection(node.address)
    with pytest.raises(ChecksumMismatch):
        conn.get_into(key("k"), bytearray(size + 200))
    assert seen == [Op.VERIFY]
    conn.ping()  # a damaged block does not break the stream
    with pytest.raises(ProtocolError):
        conn.ping()
    assert conn.closed
    with pytest.raises(TransportError):
        conn.ping()


@pytest.mark.parametrize("size", [64 * KiB, 3 * PIECEWISE_FROM], ids=["one-recv", "received-in-pieces"])
def test_a_node_that_hangs_up_mid_block_is_a_transport_error(size):
    payload = os.urandom(size)
    table = GET_ITEM.pack(Status.OK, size, xxhash.xxh3_64_intdigest(payload))
    node = FakeNode(
        [lambda op, rid: pack_header(op, rid, 1, len(table) + size, flags=1) + table + payload[: size // 2]],
        hang_up=True,
    )
    conn = TcpConnection(node.address)
    with pytest.raises(TransportError, match="mid-frame"):
        conn.get_into(key("k"), bytearray(size))
    assert conn.closed


def test_client_maps_error_frames():
    message = b"no such thing"
    node = FakeNode(
        [lambda op, rid: pack_header(Op.ERROR, rid, 0, len(message), status=Status.UNKNOWN_LEASE, flags=1) + message]
    )
    conn = TcpConnection(node.address)
    with pytest.raises(ProtocolError, match="no such thing") as info:
        conn.exists(key("k"))
    assert info.value.status == Status.UNKNOWN_LEASE and conn.closed


def test_puts_not_waited_for_on_a_connection_that_dies_are_reported_not_stored(server):
    """A node that takes the puts and goes away without answering (a fake one, so that it
    never answers): the read that finds the connection dead raises TransportError, and every
    put sent without waiting is in put_failures as a TransportError."""
    listener = socket.create_server(("127.0.0.1", 0))
    taken = threading.Event()

    def fake_node() -> None:
        sock, _ = listener.accept()
        with sock:
            head = sock.recv(HEADER.size, socket.MSG_WAITALL)  # INFO
            info = json.dumps(server.info()).encode()
            sock.sendall(pack_header(Op.INFO, HEADER.unpack(head)[5], 0, len(info), flags=1) + info)
            wanted = 5 * (64 * KiB + HEADER.size)  # the five PUT frames, at least
            got = 0
            while got < wanted:
                got += len(sock.recv(1 << 20))
            taken.set()

    thread = threading.Thread(target=fake_node, daemon=True)
    thread.start()
    conn = TcpConnection("127.0.0.1:%d" % listener.getsockname()[1])
    try:
        keys = [("ns", b"unanswered-%d" % i) for i in range(5)]
        for k in keys:
            assert conn.put_many([(k, b"v" * (64 * KiB))], wait=False) == [None]
        assert taken.wait(5)
        with pytest.raises(TransportError):
            conn.get_many([("ns", b"anything")])
        assert [k for k, _ in conn.put_failures] == keys
        assert all(isinstance(e, TransportError) for _, e in conn.put_failures)
    finally:
        conn.close()
        listener.close()
