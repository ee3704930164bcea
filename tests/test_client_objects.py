"""Sliced values through the SDK against a live pool: written a slice at a time and read a
range at a time (``Client.open_objects``, ``Client.read_objects``, ``get_ranges_into``), on
both data paths; nothing is visible before ``complete``; writers that stop, stall or give
some values up leave nothing half-written; damaged slices are misses, never wrong bytes."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from kvstore.benchmark import embedded_pool
from kvstore.master.server import MasterServer
from kvstore.node.config import ConnectionLimits, StoreConfig
from kvstore.node.daemon import NodeOptions, StorageNode
from kvstore_client import Client
from kvstore_client.errors import InvalidValue, PutFailed
from kvstore_client.slices import encode, layout, parse_header
from tests.processes import wait_for

KiB = 1 << 10


@pytest.fixture(scope="module")
def master():
    with embedded_pool(64 << 20) as address:
        yield address


@pytest.fixture(params=["shm", "tcp"])
def client(request, master):
    with Client(master, prefer_shm=request.param == "shm") as c:
        yield c


def slices_of(j: int, n: int, length: int) -> list[bytes]:
    return [bytes([(j * 31 + i) % 251]) * length for i in range(n)]


def test_written_slice_by_slice_read_back_range_by_range(client):
    ns = f"objects-{client.prefer_shm}"
    keys = [(ns, b"k%02d" % j) for j in range(12)]
    layers, length = 6, 3 * KiB
    want = [slices_of(j, layers, length) for j in range(len(keys))]
    with client.open_objects(keys, [length] * layers, depths=range(len(keys))) as writer:
        for i in range(layers):
            writer.write(i, [np.frombuffer(w[i], dtype=np.uint8) for w in want])
            assert not any(client.batch_exists(keys))  # nothing visible before complete
    assert client.get(keys[3]) == encode(want[3])  # a whole value, as any
    with client.read_objects(keys) as reader:
        for i in reversed(range(layers)):
            buffers = [bytearray(length) for _ in keys]
            assert reader.read_into(i, buffers) == [length] * len(keys)
            assert [bytes(b) for b in buffers] == [w[i] for w in want]
        two = [bytearray(2 * length) for _ in keys]
        assert reader.read_into(2, two, count=2) == [2 * length] * len(keys)
        assert bytes(two[5]) == want[5][2] + want[5][3]
    out = [bytearray(length), bytearray(3 * length)]
    assert client.get_ranges_into(keys[7], [(5, 1), range(0, 3)], out) == [length, 3 * length]
    assert bytes(out[0]) == want[7][5] and bytes(out[1]) == b"".join(want[7][:3])


def test_values_of_different_slices_in_one_writer(client):
    ns = f"ragged-{client.prefer_shm}"
    keys = [(ns, b"a"), (ns, b"b")]
    lengths = [[100, 200, 300], [5000]]
    with client.open_objects(keys, lengths) as writer:
        writer.write(0, [b"x" * 100, b"y" * 5000])
        writer.write(1, [b"z" * 200, None])
        writer.write(2, [b"w" * 300, None])
    assert client.batch_get_ranges_into(keys, [(1, 2), (0, 1)], [bytearray(500), bytearray(5000)]) == [500, 5000]
    with pytest.raises(InvalidValue):  # three slices, not four
        client.get_ranges_into(keys[0], [(3, 1)], [bytearray(10)])


def test_a_value_missing_a_slice_is_given_up_and_never_visible(client):
    ns = f"partial-{client.prefer_shm}"
    keys = [(ns, b"whole"), (ns, b"partial")]
    writer = client.open_objects(keys, [1000, 1000])
    writer.write(0, [b"a" * 1000, b"b" * 1000])
    writer.write(1, [b"c" * 1000, None])
    assert writer.incomplete == [1]
    with pytest.raises(PutFailed) as failed:
        writer.complete()
    assert [key for key, _, _ in failed.value.failures] == [keys[1]]
    assert client.exists(keys[0]) and not client.exists(keys[1])
    with Client(client.master) as other:
        assert other.get(keys[1]) is None


def test_a_writer_on_a_thread_that_ends_leaves_nothing(master):
    keys = [("ended", b"%d" % j) for j in range(4)]

    def write_and_vanish() -> None:
        with Client(master) as c:
            writer = c.open_objects(keys, [4 * KiB] * 2)
            writer.write(0, [b"q" * 4 * KiB] * 4)  # then the client closes: its connections end

    t = threading.Thread(target=write_and_vanish)
    t.start()
    t.join()
    with Client(master) as c:
        assert not any(c.batch_exists(keys)) and c.batch_get(keys) == [None] * 4


def test_wrong_slices_are_refused_at_once(client):
    writer = client.open_objects([("bad", b"k")], [10, 20])
    try:
        with pytest.raises(InvalidValue):
            writer.write(0, [b"x" * 11])
        with pytest.raises(InvalidValue):
            writer.write(2, [b"x" * 10])
        with pytest.raises(InvalidValue):
            writer.write(0, [b"x" * 10, b"y" * 10])
    finally:
        writer.abort()
    with pytest.raises(InvalidValue):
        client.open_objects([("bad", b"k")], [])
    with pytest.raises(InvalidValue):
        client.open_objects([("bad", b"k")], [[1], [2]])


def test_a_plain_value_read_by_range_is_an_invalid_value(client):
    key = (f"plain-{client.prefer_shm}", b"p")
    client.put(key, b"not sliced" * 100)
    with pytest.raises(InvalidValue):
        client.get_ranges_into(key, [(0, 1)], [bytearray(1000)])
    with client.read_objects([key, (key[0], b"absent")]) as reader:
        assert reader.read_into(0, [bytearray(1000), bytearray(1000)]) == [None, None]
        assert reader.missing == {0, 1}


@pytest.fixture
def small_pool(tmp_path):
    """A master and one node with a 2-second write TTL and damage easy to reach."""
    master = MasterServer(port=0, ttl_s=5.0, heartbeat_interval_s=0.5).start()
    node = StorageNode(
        StoreConfig(dram_capacity=16 << 20, max_block_bytes=1 << 20, connections=ConnectionLimits(write_ttl=2.0)),
        NodeOptions(master=master.address, data_dir=str(tmp_path / "n")),
    ).start()
    yield master.address, node
    node.stop()
    master.stop()


def test_a_damaged_slice_held_by_a_reader_is_a_miss_and_dropped(small_pool):
    address, node = small_pool
    keys = [("held", b"%d" % j) for j in range(3)]
    with Client(address) as client:
        with client.open_objects(keys, [2 * KiB] * 3) as writer:
            for i in range(3):
                writer.write(i, [bytes([j + i]) * 2 * KiB for j in range(3)])
        reader = client.read_objects(keys)
        where = node.store.dram.location(keys[1])
        table = parse_header(node.store.dram.get(keys[1]))
        node.store.dram.arena.view[where.offset + table.offsets[2]] ^= 0x01
        got = reader.read_into(2, [bytearray(2 * KiB) for _ in keys])
        assert got == [2 * KiB, None, 2 * KiB]
        assert reader.read_into(0, [bytearray(2 * KiB) for _ in keys]) == [2 * KiB, None, 2 * KiB]
        reader.close()  # reports the damaged value: its node checks it whole and drops it
        assert wait_for(lambda: not node.store.exists(keys[1]))


def test_a_writer_slower_than_the_write_ttl_moves_out_of_the_arena(small_pool):
    address, node = small_pool
    keys = [("slow", b"%d" % j) for j in range(4)]
    with Client(address) as client:
        writer = client.open_objects(keys, [8 * KiB] * 3)
        writer.write(0, [b"a" * 8 * KiB] * 4)
        time.sleep(1.2)  # past half the node's write_ttl: what was written moves to staging
        writer.write(1, [b"b" * 8 * KiB] * 4)
        time.sleep(1.5)  # the node would have revoked the space by now
        writer.write(2, [b"c" * 8 * KiB] * 4)
        writer.complete()  # had it stayed in the arena, its COMMIT would be answered EXPIRED (PutFailed)
        assert client.get(keys[2]) == encode([b"a" * 8 * KiB, b"b" * 8 * KiB, b"c" * 8 * KiB])


def test_space_left_unpublished_past_the_write_ttl_is_revoked(small_pool):
    address, node = small_pool
    from kvstore_client.shm import ShmConnection

    conn = ShmConnection(node.server.unix_path)
    try:
        table = layout([4 * KiB])
        [(group, _, reserved)] = conn.reserve_space([("ttl", b"k")], [table.size], [0])
        assert reserved[0][0] == 0 and node.store.stats()["store"]["granted_bytes"] == table.size
        assert wait_for(lambda: node.store.stats()["store"]["granted_bytes"] == 0, timeout=5)
        from kvstore_client.wire import Status

        assert conn.commit_space(group, [0]) == [Status.EXPIRED]
        conn.ping()  # the connection goes on
    finally:
        conn.close()


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "tcp"])
def test_an_aborted_writer_leaves_nothing_and_gives_its_space_back(small_pool, shm):
    address, node = small_pool
    keys = [("aborted", b"%d" % j) for j in range(8)]
    with Client(address, prefer_shm=shm) as client:
        with pytest.raises(RuntimeError):
            with client.open_objects(keys, [64 * KiB] * 4) as writer:
                writer.write(0, [os.urandom(64 * KiB)] * len(keys))
                if shm:  # arena space set aside: the grants' share of DRAM, then the node's allowance
                    assert held(node) >= 8 * 4 * 64 * KiB
                raise RuntimeError("the engine stopped")
        client.get(("aborted", b"x"))  # one more request: the abort, sent without a reply, is handled
        assert not any(client.batch_exists(keys))
        assert held(node) == 0


def held(node) -> int:
    """Arena space a node holds for writers, not yet published."""
    return node.store.stats()["store"]["granted_bytes"] + node.server.allowance.used


def test_values_go_to_every_replica_and_read_from_either(tmp_path):
    """A master that keeps two copies: each value is written slice by slice to both nodes,
    published on both, and a range reads from either once the other is gone."""
    master = MasterServer(port=0, ttl_s=5.0, heartbeat_interval_s=0.5, replication_factor=2).start()
    nodes = [
        StorageNode(
            StoreConfig(dram_capacity=16 << 20, max_block_bytes=1 << 20),
            NodeOptions(master=master.address, data_dir=str(tmp_path / f"n{i}")),
        ).start()
        for i in range(2)
    ]
    try:
        keys = [("replicated", b"%d" % j) for j in range(4)]
        with Client(master.address) as client:
            with client.open_objects(keys, [4 * KiB] * 3) as writer:
                for i in range(3):
                    writer.write(i, [bytes([16 * j + i]) * 4 * KiB for j in range(4)])
        assert all(node.store.exists(k) for node in nodes for k in keys)
        nodes.pop(0).stop()
        with Client(master.address) as client:
            out = [bytearray(4 * KiB) for _ in keys]
            assert client.batch_get_ranges_into(keys, [(2, 1)] * 4, out) == [4 * KiB] * 4
            assert [bytes(o)[:1] for o in out] == [bytes([16 * j + 2]) for j in range(4)]
    finally:
        for node in nodes:
            node.stop()
        master.stop()
