"""The SDK against a live pool (master and node on loopback sockets in this process)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvstore_client import AsyncClient, BlockHasher, Client, PrefixMatch
from kvstore_client.client import with_cached_locations
from kvstore_client.errors import BufferTooSmall, InvalidKey, InvalidValue, ServiceUnavailable
from kvstore.benchmark import embedded_pool
from tests.conftest import value_for
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


def test_any_buffer_in_and_out(client):
    ns = f"buffers-{client.prefer_shm}"
    arr = np.arange(5000, dtype=np.float32)
    client.put((ns, b"a" * 16), arr)
    client.put((ns, b"b" * 16), bytearray(b"xyz"))
    client.put((ns, b"c" * 16), memoryview(b"0123456789")[3:7])
    out = np.zeros(5000, dtype=np.float32)
    assert client.get_into((ns, b"a" * 16), out) == arr.nbytes and np.array_equal(out, arr)
    assert client.get((ns, b"b" * 16)) == b"xyz" and client.get((ns, b"c" * 16)) == b"3456"
    assert client.get((ns, b"z" * 16)) is None
    with pytest.raises(BufferTooSmall):
        client.get_into((ns, b"a" * 16), bytearray(100))


def test_puts_not_waited_for_are_read_back_here_and_elsewhere(client, master):
    ns = f"nowait-{client.prefer_shm}"
    keys = BlockHasher(ns, 4).keys(list(range(4 * 24)))
    values = [value_for(k, 96 * KiB) for k in keys]
    buffer = bytearray(96 * KiB)
    for k, v in zip(keys[:12], values):
        buffer[:] = v
        client.put(k, buffer, wait=False)  # the buffer is the caller's again at once
    buffer[:] = bytes(len(buffer))
    client.batch_put(keys[12:], values[12:], wait=False)
    assert client.get(keys[0]) == values[0]  # this thread reads its own puts
    client.wait_for_puts()
    with Client(master) as other:
        wait_for(lambda: all(other.batch_exists(keys)))  # the node reports new blocks to the master
        assert other.batch_get(keys) == values


def test_the_next_placement_is_asked_for_before_the_current_one_runs_out(master):
    keys = BlockHasher("ahead", 4).keys(list(range(4 * 6)))
    with Client(master, placement_bytes=256 * KiB, placement_ttl=60) as client:
        for k in keys[:2]:
            client.put(k, value_for(k, 64 * KiB))
        assert client._placements.asked_ahead("ahead") is None  # half of the placement left
        client.put(keys[2], value_for(keys[2], 64 * KiB))
        size, asked = client._placements.asked_ahead("ahead")
        assert size == 16 * 256 * KiB  # 192 KiB in milliseconds: a fast writer, 60 s of it is past the cap
        for k in keys[3:5]:
            client.put(k, value_for(k, 64 * KiB))  # the fifth needs a new placement: the one asked ahead
        assert client._placements.asked_ahead("ahead") is None and asked.done()
        for k in keys[5:]:
            client.put(k, value_for(k, 64 * KiB))  # 4 MiB: room for all of them without asking
        assert client._placements.asked_ahead("ahead") is None
        assert client.batch_get(keys) == [value_for(k, 64 * KiB) for k in keys]


def test_typed_errors(client):
    with pytest.raises(InvalidValue):
        client.put(("m", b"k" * 16), b"")
    with pytest.raises(InvalidValue):
        client.put(("m", b"k" * 16), b"x" * (65 << 20))
    with pytest.raises(InvalidKey):
        client.put(("", b"k"), b"x")
    with pytest.raises(InvalidValue):
        client.batch_put([("m", b"k" * 16)], [])
    assert client.get(("m", b"k" * 16)) is None  # nothing half-stored


def test_token_helpers_store_and_load_a_prefix(client):
    hasher = BlockHasher(f"tokens-{client.prefer_shm}", block_size=16)
    tokens = list(range(200))  # 12 full blocks
    blocks = [value_for(i, 8 * KiB) for i in range(12)]
    assert client.store_prefix(hasher, tokens[:96], blocks[:6]) == 6
    assert client.store_prefix(hasher, tokens, blocks, wait=False) == 6  # the first six are already there
    out = [bytearray(8 * KiB) for _ in range(12)]
    assert client.load_prefix(hasher, tokens, out) == 192
    assert [bytes(o) for o in out] == blocks
    other = list(tokens)
    other[20] = 99999  # diverges in block 1
    assert client.load_prefix(hasher, other, [bytearray(8 * KiB) for _ in range(12)]) == 16
    client.wait_for_puts()


def test_match_prefix_sees_own_writes_per_node_at_once(client):
    keys = [(f"own-{client.prefer_shm}", bytes([i]) * 16) for i in range(5)]
    client.batch_put(keys, [value_for(i, 4 * KiB) for i in range(5)], depths=range(5))
    match = client.match_prefix(keys)  # before or after the master has indexed them: the same answer
    (node_id,) = {n.info.node_id for n in client.cluster_status().nodes}
    assert match == PrefixMatch(5, {node_id: 5})


def test_cached_locations_extend_a_match_overall_and_per_node():
    cached = [(("a", 1),), (("a", 1), ("b", 1)), (("b", 1),), None, (("a", 1),)]
    got = with_cached_locations(PrefixMatch(1, {"a": 1, "c": 1}), cached)
    assert got == PrefixMatch(3, {"a": 2, "c": 1})  # b holds block 1 but not block 0: no leading run
    assert with_cached_locations(PrefixMatch(0, {}), [None, (("a", 1),)]) == PrefixMatch(0, {})
    assert with_cached_locations(PrefixMatch(2, {"b": 2}), [(), (), (("b", 1),)]) == PrefixMatch(3, {"b": 3})


def test_remove_and_exists(client):
    key = (f"rm-{client.prefer_shm}", b"r" * 16)
    client.put(key, b"bye")
    assert client.exists(key) or client.get(key) == b"bye"
    assert client.remove(key) is True
    assert client.get(key) is None


def test_async_client(master):
    async def scenario():
        async with AsyncClient(master) as client:
            keys = BlockHasher("async", 4).keys(list(range(40)))
            values = [value_for(k, 4 * KiB) for k in keys]
            await client.batch_put(keys, values)
            got = await asyncio.gather(*(client.get(k) for k in keys))
            assert list(got) == values
            assert (await client.match_prefix(keys)).longest == len(keys)

    asyncio.run(scenario())


def test_unreachable_master_is_service_unavailable():
    with Client("127.0.0.1:1", timeout=2) as client:
        with pytest.raises(ServiceUnavailable):
            client.get(("m", b"k" * 16))


def test_torch_cpu_tensors_in_and_out(client):
    torch = pytest.importorskip("torch")
    ns = f"torch-{client.prefer_shm}"
    kv = torch.arange(4096, dtype=torch.bfloat16).reshape(2, 2048)
    client.put((ns, b"t" * 16), kv)
    out = torch.empty_like(kv)
    assert client.get_into((ns, b"t" * 16), out) == kv.numel() * kv.element_size()
    assert torch.equal(out, kv)
    with pytest.raises(InvalidValue):
        client.put((ns, b"u" * 16), kv.t())  # not contiguous


@pytest.fixture
def two_replicas(tmp_path):
    """A master that keeps two copies of every block, and its two nodes, in this process."""
    from kvstore.master.server import MasterServer
    from kvstore.node.config import StoreConfig
    from kvstore.node.daemon import NodeOptions, StorageNode

    master = MasterServer(port=0, ttl_s=5.0, heartbeat_interval_s=0.5, replication_factor=2).start()
    nodes = [
        StorageNode(
            StoreConfig(dram_capacity=16 << 20, max_block_bytes=1 << 20),
            NodeOptions(master=master.address, data_dir=str(tmp_path / f"n{i}")),
        ).start()
        for i in range(2)
    ]  # start() returns once the master knows the node
    yield master.address, nodes
    for node in nodes:
        node.stop()
    master.stop()


def damage(node, key) -> None:
    """Flip a byte of the node's copy of ``key`` in its arena (the checksum stays the old one)."""
    where = node.store.dram.location(key)
    node.store.dram.arena.view[where.offset] ^= 0xFF


@pytest.mark.parametrize("shm", [False, True], ids=["tcp", "shm"])
def test_a_damaged_copy_is_read_from_another_replica_then_dropped(two_replicas, shm):
    from tests.processes import wait_for

    address, nodes = two_replicas
    keys = [(f"damaged-{shm}", bytes([i]) * 16) for i in range(2)]
    values = [value_for(k, 32 * KiB) for k in keys]
    with Client(address, prefer_shm=shm, location_ttl=0) as client:
        client.batch_put(keys, values)
        assert all(n.store.exists(k) for n in nodes for k in keys)  # two copies of each
        wait_for(lambda: all(len(r) == 2 for r in client._locate(keys, use_cache=False)))
        damage(nodes[0], keys[0])  # whichever node is tried first, one good copy is left
        damage(nodes[1], keys[1])
        assert client.batch_get(keys) == values
        out = [bytearray(32 * KiB) for _ in keys]
        assert client.batch_get_into(keys, out) == [32 * KiB] * 2 and out == values
        damage(nodes[1], keys[0])  # now every copy of the first block is damaged
        assert client.get(keys[0]) is None  # a miss, as for a damaged SSD record: never an error, never wrong bytes
        assert not any(n.store.exists(keys[0]) for n in nodes)
        assert client.get(keys[1]) == values[1]


def test_same_host_reads_of_published_blocks_need_no_master(tmp_path):
    """A block in a same-host node's directory is read without a round trip to anyone: with
    the master gone, get, get_into and batch_get still return it; a block not published there
    needs the master (ServiceUnavailable)."""
    from kvstore.master.server import MasterServer
    from kvstore.node.config import StoreConfig
    from kvstore.node.daemon import NodeOptions, StorageNode

    master = MasterServer(port=0, ttl_s=5.0, heartbeat_interval_s=0.5).start()
    node = StorageNode(
        StoreConfig(dram_capacity=16 << 20), NodeOptions(master=master.address, data_dir=str(tmp_path / "n"))
    ).start()
    try:
        with Client(master.address, timeout=2.0) as client:
            keys = [("direct", bytes([i]) * 16) for i in range(3)]
            values = [value_for(k, 10 * KiB + i) for i, k in enumerate(keys)]
            client.batch_put(keys, values)
            assert client.get(keys[0]) == values[0]  # the first read dials the node (locate, then map)
            master.stop()
            out = bytearray(len(values[1]))
            assert client.get_into(keys[1], out) == len(out) and out == values[1]
            assert client.get(keys[2]) == values[2]
            assert client.batch_get(keys) == values
            with pytest.raises(ServiceUnavailable):
                client.get(("direct", b"\xee" * 16))  # not in the directory: only the master knows
    finally:
        node.stop()
        master.stop()
