"""The same-host fast paths: one-sided reads through a node's block directory, and puts
into space the node granted after the previous put.

The directory (kvstore_client.directory) lets a same-host client find a block
in the node's arena and copy it without a round trip, validating the copy
afterwards. These tests check the format's contract (writer and reader
together), that such reads take no lease yet count as hits that keep blocks
warm, that a copy racing replacements and reuse of the space never returns
wrong bytes (with and without checksums), and that a killed node stops being
read within the directory's lifetime. Then that a run of same-sized puts goes
through grants (one STORE each), and that grants end with their connection.
"""

from __future__ import annotations

import os
import time

import pytest
import xxhash

from kvstore.node.config import StoreConfig
from kvstore.node.store import BlockStore
from kvstore.tiers.directory import BlockDirectory
from kvstore.transport.server import DIRECTORY_LIFETIME, DataPlaneServer
from kvstore_client import Client
from kvstore_client.checked_copy import CHUNK
from kvstore_client.directory import ONE_SIDED_READS, DirectoryReader, bucket_of, key_tag
from kvstore_client.transport import ShmConnection
from tests.conftest import value_for
from tests.processes import start_master, start_node, wait_for

pytestmark = pytest.mark.skipif(not ONE_SIDED_READS, reason="one-sided reads need x86-64 memory ordering")

KiB = 1 << 10
BLOCK = 64 * KiB


def key(name: str) -> tuple[str, bytes]:
    return ("ns", xxhash.xxh3_128_digest(name.encode()))


def uniform(version: int, size: int = BLOCK) -> bytes:
    """A block whose every byte says which version it is: a torn copy cannot pass for one."""
    return bytes([version % 251 + 1]) * size


# -- the format: writer and reader together ----------------------------------------------------
@pytest.fixture
def directory(tmp_path):
    writer = BlockDirectory(str(tmp_path / "blocks.dir"), arena_size=1 << 20, slots=64, ways=4)
    writer.beat(10.0)
    reader = DirectoryReader(writer.path, arena_size=1 << 20)
    yield writer, reader
    reader.close()
    writer.close()


def test_published_blocks_are_found_and_unpublished_ones_are_not(directory):
    writer, reader = directory
    assert reader.find(key("a")) is None
    assert writer.publish(key("a"), 4096, 100, 0xABC)
    position, seq, offset, size, checksum = reader.find(key("a"))
    assert (offset, size, checksum) == (4096, 100, 0xABC) and seq % 2 == 0
    assert reader.unchanged(position, seq)
    writer.unpublish(key("a"))
    assert reader.find(key("a")) is None and not reader.unchanged(position, seq)


def test_a_replaced_block_invalidates_copies_begun_before(directory):
    writer, reader = directory
    writer.publish(key("a"), 0, 10, 1)
    position, seq, *_ = reader.find(key("a"))
    writer.publish(key("a"), 8192, 20, 2)
    assert not reader.unchanged(position, seq)
    assert reader.find(key("a"))[2:] == (8192, 20, 2)
    assert len(writer) == 1


def test_a_full_bucket_leaves_blocks_unpublished(directory):
    writer, _ = directory
    target = bucket_of(key_tag(key("x0")), writer.buckets)
    same_bucket = [k for k in (key(f"x{i}") for i in range(5000)) if bucket_of(key_tag(k), writer.buckets) == target]
    assert len(same_bucket) > writer.ways
    assert all(writer.publish(k, 0, 1, 0) for k in same_bucket[: writer.ways])
    assert not writer.publish(same_bucket[writer.ways], 0, 1, 0)
    assert writer.unpublished == 1
    writer.unpublish(same_bucket[0])  # a slot frees up
    assert writer.publish(same_bucket[writer.ways], 0, 1, 0)


def test_readers_stop_trusting_a_directory_that_is_not_kept_alive(directory):
    writer, reader = directory
    assert reader.alive()
    writer.beat(0.05)
    time.sleep(0.1)
    assert not reader.alive()
    writer.beat(10.0)
    assert reader.alive()
    writer.close()
    assert not reader.alive()  # a clean shutdown stops readers at once
    assert not os.path.exists(writer.path)


def test_a_reader_refuses_a_directory_of_another_arena(directory):
    writer, _ = directory
    with pytest.raises(ValueError):
        DirectoryReader(writer.path, arena_size=2 << 20)


# -- through a node ------------------------------------------------------------------------------
@pytest.fixture
def node(tmp_path):
    store = BlockStore(StoreConfig(dram_capacity=16 * BLOCK, max_block_bytes=BLOCK, background_eviction=False))
    server = DataPlaneServer(store, unix_path=str(tmp_path / "dp.sock"), lease_ttl=None).start()
    yield server
    server.stop()
    store.close()


def test_one_sided_reads_take_no_lease_and_count_as_hits(node, monkeypatch):
    monkeypatch.setattr("kvstore_client.shm.TOUCH_DELAY", 60.0)  # report only with a request, whatever the pace
    store, k = node.store, key("hit")
    store.put(k, uniform(1))
    hits_before = store.stats()["dram"]["hits"]
    with ShmConnection(node.unix_path) as conn:
        assert conn.one_sided
        buffer = bytearray(BLOCK)
        assert conn.get_into(k, buffer) == BLOCK and buffer == uniform(1)
        assert conn.get(k) == uniform(1)
        assert not store.dram.is_leased(k)  # nothing to release: no lease was taken
        assert store.stats()["dram"]["hits"] == hits_before  # not reported yet...
        assert conn.get_many([k, key("missing")]) == [uniform(1), None]  # the miss asks the node...
        assert store.stats()["dram"]["hits"] == hits_before + 3  # ...and the three reads went with it
        assert conn.get(k) == uniform(1)
        conn.flush()
        assert store.stats()["dram"]["hits"] == hits_before + 4


def test_blocks_read_one_sidedly_stay_warm(node):
    store = node.store
    keys = [key(f"warm-{i}") for i in range(12)]
    for i, k in enumerate(keys):
        store.put(k, uniform(i))
    with ShmConnection(node.unix_path) as conn:
        assert conn.get(keys[0]) == uniform(0)  # the oldest block, read without asking the node
        conn.flush()
    for i in range(12, 24):  # LRU pressure: evicts the least recently used
        store.put(key(f"warm-{i}"), uniform(i))
    assert store.exists(keys[0])
    assert not store.exists(keys[1])


class RacedShm(ShmConnection):
    """Between finding a block in the directory and copying it, replaces the block and stores
    other blocks until one lies where the found bytes were (for the next ``races`` reads):
    the copy then reads a stranger's bytes, and validation must turn it down."""

    def __init__(self, target: str, store: BlockStore, races: int, **options):
        super().__init__(target, **options)
        self.store, self.races, self.reused = store, races, 0
        find = self._direct._find

        def racing_find(k):
            found = find(k)
            if found is not None and self.races:
                self.races -= 1
                self._reuse(k, offset=found[2], size=found[3])
            return found

        self._direct._find = racing_find

    def _reuse(self, k, offset: int, size: int) -> None:
        store, dram = self.store, self.store.dram
        store.put(k, uniform(200))
        for i in range(64):
            filler = key(f"filler-{self.reused}-{i}")
            store.put(filler, uniform(100))
            extent = dram.location(filler)
            if extent.offset < offset + size and offset < extent.offset + extent.size:
                self.reused += 1
                return
        raise AssertionError("no block came to lie where the found one was")


@pytest.mark.parametrize("verify", [True, False], ids=["checksum", "seqlock-only"])
@pytest.mark.parametrize("call", ["read_direct", "get_into", "get"])
def test_a_copy_of_reused_space_is_never_returned(node, verify, call):
    k = key("raced")
    node.store.put(k, uniform(1))
    with RacedShm(node.unix_path, node.store, races=1, verify=verify) as conn:
        buffer = bytearray(BLOCK)
        if call == "read_direct":
            assert conn.read_direct([k], [buffer]) == [None]  # turned down: the caller must ask the node
        elif call == "get_into":
            assert conn.get_into(k, buffer) == BLOCK and buffer == uniform(200)  # then read under a lease
        else:
            assert conn.get(k) == uniform(200)
        assert conn.reused == 1  # the race really happened
        assert conn.get(k) == uniform(200)  # and the next read is one-sided again


@pytest.mark.parametrize("one_sided", [True, False], ids=["one-sided", "leased"])
def test_a_block_damaged_past_its_first_chunk_is_never_returned(tmp_path, one_sided):
    """Reads of a block bigger than one checksummed chunk (``checked_copy.CHUNK``) whose
    arena bytes changed behind the checksum, at its very end."""
    size = 2 * CHUNK + 4097
    store = BlockStore(StoreConfig(dram_capacity=4 * size, max_block_bytes=size, background_eviction=False))
    server = DataPlaneServer(store, unix_path=str(tmp_path / "dp.sock"), lease_ttl=None).start()
    try:
        k, good = key("damaged-late"), os.urandom(size)
        store.put(k, good)
        where = store.dram.location(k)
        store.dram.arena.view[where.offset + size - 1] ^= 0x01
        with ShmConnection(server.unix_path, one_sided=one_sided) as conn:
            buffer = bytearray(size)
            assert conn.read_direct([k], [buffer]) == [None]  # turned down, whichever way it was asked
            assert conn.get_into(k, buffer) is None  # leased twice, then the node's GET finds it damaged...
            assert not store.exists(k)  # ...and drops it: a miss, never wrong bytes
            store.put(k, good)
            assert conn.get_into(k, buffer) == size and buffer == good
            assert conn.get(k) == good
    finally:
        server.stop()
        store.close()


def test_a_killed_node_stops_serving_one_sided_reads(tmp_path):
    master = start_master(ttl=5.0)
    node = start_node(master.record["master"], tmp_path / "n")
    try:
        keys = [key(f"killed-{i}") for i in range(8)]
        values = [value_for(k, 32 * KiB) for k in keys]
        with Client(master.record["master"]) as client:
            wait_for(lambda: any(n.alive for n in client.cluster_status().nodes))
            client.batch_put(keys, values)
            assert client.batch_get(keys) == values
            conn = next(iter(client._local.conns.values()))
            assert conn.one_sided and conn.read_direct(keys[:1])[0] == values[0]
            node.kill()
            seen = []

            def all_missing() -> bool:
                got = client.batch_get(keys)
                seen.append(got)
                return got == [None] * len(keys)

            wait_for(all_missing, timeout=DIRECTORY_LIFETIME + 9)
            assert all(g is None or g == v for got in seen for g, v in zip(got, values))  # never wrong bytes
    finally:
        node.close()
        master.close()


@pytest.fixture
def writer_node(tmp_path):
    """A node of 64 blocks of DRAM whose connections write through grants (its store is ``.store``)."""
    store = BlockStore(StoreConfig(dram_capacity=64 * BLOCK, max_block_bytes=BLOCK, background_eviction=False))
    server = DataPlaneServer(store, unix_path=str(tmp_path / "dp.sock")).start()
    yield server
    server.stop()
    store.close()


def test_same_sized_puts_go_through_grants_and_grants_end_with_the_connection(writer_node):
    server, store = writer_node, writer_node.store
    used = store.stats()["dram"]["used"]
    keys = [key(f"granted-{i}") for i in range(6)]
    with ShmConnection(server.unix_path) as conn:
        grants = []
        for i, k in enumerate(keys):
            conn.put(k, uniform(i))
            grants.append(conn._grants[-1][0])  # the grant left for the next put
        assert len(set(grants)) == len(keys)  # each put used the last grant and got a fresh one
        assert [store.get(k) for k in keys] == [uniform(i) for i in range(len(keys))]
        assert store.stats()["dram"]["used"] == used + (len(keys) + 1) * BLOCK  # the blocks and one grant
        conn.put(key("odd-size"), b"x" * 1000)  # another size: the grant is given back, RESERVE is used
        assert store.get(key("odd-size")) == b"x" * 1000
    wait_for(lambda: server.connections == 0)
    assert store.stats()["dram"]["used"] == used + len(keys) * BLOCK + 4096  # no grant left behind


def test_writers_not_waiting_share_at_most_an_eighth_of_dram_in_grants(writer_node):
    store = writer_node.store
    conns = [ShmConnection(writer_node.unix_path) for _ in range(4)]  # 3 grants each wanted, room for 8 in all
    try:
        keys = {(w, i): key(f"writer-{w}-{i}") for w in range(len(conns)) for i in range(10)}
        for i in range(10):
            for w, conn in enumerate(conns):
                conn.put(keys[w, i], uniform(10 * w + i), wait=False)
            assert store.stats()["store"]["granted_bytes"] <= 8 * BLOCK
        for conn in conns:
            conn.settle()
            assert not conn.put_failures
        assert {k: store.get(k) for k in keys.values()} == {k: uniform(10 * w + i) for (w, i), k in keys.items()}
        assert sum(len(conn._grants) for conn in conns) <= 8 < 3 * len(conns)
    finally:
        for conn in conns:
            conn.close()
