"""Slices of sliced values over the data plane's sockets (GET_RANGES, proto/dataplane.md):
each range lands straight in its buffer with its slices checked one by one; plain values,
short ones and damaged ones answer with typed errors or misses, never wrong bytes; and a
sliced value lives through a node's every path (SSD tier, PULL) like any other."""

from __future__ import annotations

import os
import random

import pytest

from kvstore.node.config import StoreConfig
from kvstore.node.store import BlockStore
from kvstore.transport.server import DataPlaneServer
from kvstore_client.errors import BufferTooSmall, ChecksumMismatch, InvalidValue
from kvstore_client.slices import encode, parse_header, value_checksum
from kvstore_client.shm import ShmConnection
from kvstore_client.transport import TcpConnection, UnixConnection

KiB = 1 << 10
MiB = 1 << 20


@pytest.fixture
def node(tmp_path):
    store = BlockStore(
        StoreConfig(
            dram_capacity=8 * MiB,
            ssd_path=str(tmp_path / "ssd"),
            ssd_capacity=64 * MiB,
            granule=4 * KiB,
            max_block_bytes=MiB,
        )
    )
    server = DataPlaneServer(store, unix_path=str(tmp_path / "node.sock")).start()
    yield store, server
    server.stop()
    store.close()


def parts_of(n: int, size: int = 3 * KiB) -> list[bytes]:
    return [os.urandom(size + i) for i in range(n)]


@pytest.fixture(params=["tcp", "unix", "shm"])
def conn(request, node):
    _, server = node
    if request.param == "tcp":
        c = TcpConnection(server.address)
    elif request.param == "unix":
        c = UnixConnection(server.unix_path)
    else:
        c = ShmConnection(server.unix_path)
        assert c.one_sided
    yield c
    c.close()


def test_ranges_land_in_their_buffers(conn):
    parts = parts_of(6)
    key = ("ns", b"sliced")
    conn.put(key, encode(parts))
    ranges = [(0, 1), (5, 1), (2, 3), range(1, 2), (0, 6)]
    buffers = [bytearray(sum(len(p) for p in parts)) for _ in ranges]
    sizes, errors = conn.read_ranges([key] * len(ranges), ranges, buffers)
    assert not errors
    for r, size, buf in zip([(0, 1), (5, 1), (2, 3), (1, 1), (0, 6)], sizes, buffers):
        want = b"".join(parts[r[0] : r[0] + r[1]])
        assert size == len(want) and bytes(buf[:size]) == want


def test_misses_plain_values_and_bad_ranges_are_told_apart(conn):
    conn.put(("ns", b"plain"), os.urandom(4 * KiB))
    conn.put(("ns", b"sliced"), encode(parts_of(2)))
    keys = [("ns", b"absent"), ("ns", b"plain"), ("ns", b"sliced"), ("ns", b"sliced")]
    sizes, errors = conn.read_ranges(keys, [(0, 1), (0, 1), (1, 2), (0, 1)], [bytearray(8 * KiB) for _ in keys])
    assert sizes[0] is None and 0 not in errors  # a miss
    assert isinstance(errors[1], InvalidValue) and isinstance(errors[2], InvalidValue)
    assert sizes[3] == 3 * KiB and 3 not in errors


def test_a_buffer_too_small_for_its_range_is_told_and_the_rest_still_land(conn):
    parts = parts_of(3)
    conn.put(("ns", b"v"), encode(parts))
    small, fits = bytearray(100), bytearray(8 * KiB)
    sizes, errors = conn.read_ranges([("ns", b"v"), ("ns", b"v")], [(0, 1), (2, 1)], [small, fits])
    assert isinstance(errors[0], BufferTooSmall) and errors[0].needed == len(parts[0])
    assert bytes(fits[: sizes[1]]) == parts[2]


def test_bad_ranges_are_refused_before_anything_is_sent(conn):
    for bad in [(0, 0), (-1, 1), (1,), range(0, 4, 2), "0:1"]:
        with pytest.raises(InvalidValue):
            conn.read_ranges([("ns", b"k")], [bad], [bytearray(10)])


def test_a_slice_damaged_in_dram_is_a_miss_and_dropped(node, conn):
    store, _ = node
    parts = parts_of(4)
    key = ("ns", b"damaged")
    conn.put(key, encode(parts))
    where = store.dram.location(key)
    table = parse_header(store.dram.get(key))
    store.dram.arena.view[where.offset + table.offsets[2] + 7] ^= 0x10
    buffers = [bytearray(4 * KiB), bytearray(4 * KiB)]
    sizes, errors = conn.read_ranges([key, key], [(0, 1), (2, 1)], buffers)
    assert sizes[1] is None and not errors  # checked at the node when it arrived damaged: dropped
    assert bytes(buffers[0][: sizes[0]]) == parts[0]  # the slice read before the damaged one is good
    assert not store.exists(key)


def test_a_damaged_header_is_a_miss_and_dropped(node, conn):
    store, _ = node
    key = ("ns", b"header")
    conn.put(key, encode(parts_of(2)))
    store.dram.arena.view[store.dram.location(key).offset + 20] ^= 0x01  # a slice's checksum in the table
    sizes, errors = conn.read_ranges([key], [(0, 1)], [bytearray(4 * KiB)])
    assert sizes == [None] and not errors and not store.exists(key)


def test_a_sliced_value_on_ssd_only_is_read_by_range(node, conn):
    store, _ = node
    parts = parts_of(3, 64 * KiB)
    key = ("ns", b"cold")
    value = encode(parts)
    conn.put(key, value)
    filler = os.urandom(512 * KiB)
    i = 0
    while store.tier_of(key) != "ssd":  # pushed out of DRAM by newer blocks
        conn.put(("fill", b"%d" % i), filler)
        i += 1
        store.evict()
    buf = bytearray(64 * KiB + 1)
    sizes, errors = conn.read_ranges([key], [(1, 1)], [buf])
    assert not errors and bytes(buf[: sizes[0]]) == parts[1]
    assert conn.get(key) == value  # whole, as any value


def test_whole_reads_of_a_sliced_value_check_every_slice(node, conn):
    store, _ = node
    key = ("ns", b"whole")
    value = encode(parts_of(3))
    conn.put(key, value)
    assert store.dram.location(key).checksum == value_checksum(value)
    store.dram.arena.view[store.dram.location(key).offset + len(value) - 1] ^= 0x01
    assert conn.get(key) is None and not store.exists(key)  # damaged at the node: dropped, a miss


def test_pull_copies_a_sliced_value_node_to_node(tmp_path, node):
    store, server = node
    parts = parts_of(5, 10 * KiB)
    key = ("ns", b"pulled")
    with TcpConnection(server.address) as c:
        c.put(key, encode(parts))
    other = BlockStore(StoreConfig(dram_capacity=8 * MiB, granule=4 * KiB, max_block_bytes=MiB))
    target = DataPlaneServer(other).start()
    target.puller.sources = lambda address: address == server.address
    try:
        with TcpConnection(target.address) as c:
            assert c.pull_many(server.address, [(key, 0)]) == [True]
            buf = bytearray(11 * KiB)
            sizes, errors = c.read_ranges([key], [(4, 1)], [buf])
            assert not errors and bytes(buf[: sizes[0]]) == parts[4]
    finally:
        target.stop()
        other.close()


def test_random_ranges_of_random_values(conn):
    rng = random.Random(7)
    values = {}
    for i in range(20):
        parts = [rng.randbytes(rng.randint(1, 5000)) for _ in range(rng.randint(1, 30))]
        values[("ns", b"r%d" % i)] = parts
        conn.put(("ns", b"r%d" % i), encode(parts))
    keys, ranges, want = [], [], []
    for _ in range(200):
        key = rng.choice(list(values))
        parts = values[key]
        first = rng.randrange(len(parts))
        count = rng.randint(1, len(parts) - first)
        keys.append(key)
        ranges.append((first, count))
        want.append(b"".join(parts[first : first + count]))
    buffers = [bytearray(len(w)) for w in want]
    sizes, errors = conn.read_ranges(keys, ranges, buffers)
    assert not errors and [bytes(b) for b in buffers] == want and sizes == [len(w) for w in want]


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_a_sliced_value_whose_slices_do_not_match_its_table_is_refused(node, transport):
    """A PUT's bytes are hashed as they land, slices included. (Same-host writers copy into the
    arena themselves and are trusted with their checksums, as for any value: readers of a
    range check it.)"""
    _, server = node
    conn = TcpConnection(server.address) if transport == "tcp" else UnixConnection(server.unix_path)
    value = bytearray(encode(parts_of(3)))
    value[-1] ^= 0x01  # the writer's own bytes disagree with its table
    with pytest.raises(ChecksumMismatch):
        conn.put(("ns", b"inconsistent"), bytes(value))  # whatever checksum it declares (its own: flipped)
    assert conn.get(("ns", b"inconsistent")) is None
    conn.close()
