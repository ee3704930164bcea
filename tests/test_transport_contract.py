"""One conformance suite for every data-plane transport (TCP, Unix socket, shared memory).

Each test runs against a DataPlaneServer over a real BlockStore (DRAM + SSD
in a temporary directory, background eviction on), once with the node in
this process and once with the node in a process of its own
(tests/dataplane_node.py). The in-process store promotes SSD hits to DRAM;
the separate node does not (``--no-promote``), so there shared-memory reads
of SSD-resident blocks take the NOT_IN_DRAM -> GET path.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kvstore.node.config import StoreConfig
from kvstore.node.store import BlockStore
from kvstore.transport.server import DataPlaneServer
from kvstore_client.errors import BufferTooSmall, InvalidKey, InvalidValue, UnknownNamespace
from kvstore_client.transport import ShmConnection, TcpConnection, UnixConnection

KiB, MiB = 1 << 10, 1 << 20
MAX_BLOCK = 4 * MiB
MAX_FRAME = 6 * MiB  # small, so batches split on the client and GET replies defer on the node
DRAM, SSD = 24 * MiB, 128 * MiB
NAMESPACES = ("ns", "other")
NODE_SCRIPT = Path(__file__).with_name("dataplane_node.py")


@dataclass
class Node:
    address: str
    unix_path: str
    store: BlockStore | None  # None when the node runs in another process


@pytest.fixture(scope="module", params=["in-process", "subprocess"])
def node(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"node-{request.param}")
    unix_path = str(tmp / "dp.sock")
    if request.param == "in-process":
        store = BlockStore(
            StoreConfig(
                dram_capacity=DRAM,
                ssd_path=str(tmp / "ssd"),
                ssd_capacity=SSD,
                max_block_bytes=MAX_BLOCK,
                namespaces=frozenset(NAMESPACES),
            )
        )
        server = DataPlaneServer(store, unix_path=unix_path, max_frame_bytes=MAX_FRAME).start()
        yield Node(server.address, unix_path, store)
        server.stop()
        store.close()
        return
    proc = subprocess.Popen(
        [
            sys.executable,
            str(NODE_SCRIPT),
            "--unix",
            unix_path,
            "--ssd-path",
            str(tmp / "ssd"),
            "--dram",
            str(DRAM),
            "--ssd",
            str(SSD),
            "--max-block",
            str(MAX_BLOCK),
            "--max-frame",
            str(MAX_FRAME),
            "--namespaces",
            ",".join(NAMESPACES),
            "--no-promote",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        ready = json.loads(proc.stdout.readline())
        yield Node(ready["address"], ready["unix_path"], None)
    finally:
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(params=["tcp", "unix", "shm", "shm-leased"])
def connect(request, node):
    """Factory of connections of the parametrised transport to the node; all closed after the test."""
    opened = []

    def make(**options):
        if request.param == "tcp":
            conn = TcpConnection(node.address, **options)
        elif request.param == "unix":
            conn = UnixConnection(node.unix_path, **options)
        else:  # "shm" reads through the block directory first; "shm-leased" always takes leases
            conn = ShmConnection(node.unix_path, one_sided=request.param == "shm", **options)
        opened.append(conn)
        return conn

    make.transport = request.param
    yield make
    for conn in opened:
        conn.close()


@pytest.fixture
def shm_connect(node):
    """Factory of shared-memory connections to the node, for what only that transport has (leases)."""
    opened = []

    def make(**options):
        opened.append(ShmConnection(node.unix_path, **options))
        return opened[-1]

    yield make
    for conn in opened:
        conn.close()


def keys_for(tag: str, n: int, namespace: str = "ns") -> list:
    return [(namespace, xxhash.xxh3_128_digest(f"{tag}/{i}".encode())) for i in range(n)]


def value(tag: str, size: int) -> bytes:
    return np.random.default_rng(xxhash.xxh3_64_intdigest(f"{tag}/{size}".encode())).bytes(size)


SIZES = [1, 7, 4095, 4096, 4097, 65536, MiB + 3, MAX_BLOCK]


def test_round_trip_of_many_sizes(connect):
    conn = connect()
    keys = keys_for(f"sizes-{connect.transport}", len(SIZES))
    values = [value(f"sizes-{connect.transport}", s) for s in SIZES]
    assert conn.put_many([(k, v, d) for d, (k, v) in enumerate(zip(keys, values))]) == [None] * len(SIZES)
    assert conn.get_many(keys) == values
    exact = [bytearray(s) for s in SIZES]
    roomy = [np.zeros(s + 100, dtype=np.uint8) for s in SIZES]
    assert conn.get_into_many(keys, exact) == SIZES
    assert conn.get_into_many(keys, roomy) == SIZES
    for buf, big, v in zip(exact, roomy, values):
        assert bytes(buf) == v and big[: len(v)].tobytes() == v and not big[len(v) :].any()
    assert conn.get(keys[0]) == values[0] and conn.get_into(keys[-1], exact[-1]) == MAX_BLOCK


def test_batches_keep_order_with_misses_and_repeats(connect):
    conn = connect()
    keys = keys_for(f"batch-{connect.transport}", 40)
    values = [value(f"batch-{connect.transport}-{i}", 8 * KiB + i) for i in range(40)]
    assert conn.put_many(list(zip(keys, values))) == [None] * 40
    missing = keys_for("never-stored", 3)
    order = [5, 0, 39, 5, 17] + list(range(40))
    asked = [keys[i] for i in order[:3]] + [missing[0]] + [keys[i] for i in order[3:]] + missing[1:]
    expected = [values[i] for i in order[:3]] + [None] + [values[i] for i in order[3:]] + [None, None]
    assert conn.get_many(asked) == expected
    buffers = [bytearray(9 * KiB) for _ in asked]
    sizes = conn.get_into_many(asked, buffers)
    assert sizes == [None if e is None else len(e) for e in expected]
    assert all(e is None or bytes(b[: len(e)]) == e for b, e in zip(buffers, expected))
    assert conn.exists_many(asked) == [e is not None for e in expected]


def test_batches_larger_than_a_frame_are_split(connect):
    conn = connect()
    keys = keys_for(f"split-{connect.transport}", 9)
    values = [value(f"split-{connect.transport}-{i}", MiB + i) for i in range(9)]  # 9 MiB > MAX_FRAME
    assert conn.put_many(list(zip(keys, values))) == [None] * 9
    assert conn.get_many(keys) == values  # the node defers what overflows a reply
    buffers = [np.empty(MiB + 16, dtype=np.uint8) for _ in keys]
    assert conn.get_into_many(keys, buffers) == [len(v) for v in values]
    assert all(b[: len(v)].tobytes() == v for b, v in zip(buffers, values))


def test_many_small_keys_take_several_pipelined_frames(connect):
    conn = connect()
    keys = keys_for(f"many-{connect.transport}", 700)  # > 2 frames of keys
    values = [i.to_bytes(4, "little") * 25 for i in range(700)]
    assert conn.put_many(list(zip(keys, values))) == [None] * 700
    assert conn.get_many(keys) == values
    buffers = [bytearray(100) for _ in keys]
    assert conn.get_into_many(keys, buffers) == [100] * 700 and [bytes(b) for b in buffers] == values
    assert conn.remove_many(keys[::2]) == [True] * 350
    assert conn.exists_many(keys) == [i % 2 == 1 for i in range(700)]


def test_exists_and_remove(connect):
    conn = connect()
    keys = keys_for(f"remove-{connect.transport}", 4)
    conn.put_many([(k, b"x" * 100) for k in keys])
    assert conn.exists_many(keys) == [True] * 4
    assert conn.remove_many(keys[:2] + keys[:1]) == [True, True, False]
    assert conn.exists_many(keys) == [False, False, True, True]
    assert conn.get_many(keys) == [None, None, b"x" * 100, b"x" * 100]
    assert conn.remove(keys[3]) and not conn.exists(keys[3])


def test_numpy_buffers_in_and_out(connect):
    conn = connect()
    key = keys_for(f"numpy-{connect.transport}", 1)[0]
    src = np.arange(64 * 1024, dtype=np.float32).reshape(256, 256)
    conn.put(key, src, depth=3)
    out = np.zeros((256, 256), dtype=np.float32)
    assert conn.get_into(key, out) == src.nbytes
    np.testing.assert_array_equal(out, src)
    with pytest.raises(InvalidValue):
        conn.get_into(key, np.zeros((512, 512), dtype=np.float32)[:, ::2])  # not contiguous
    assert conn.put_many([(key, src[:, ::2])])[0].__class__ is InvalidValue


def test_buffer_too_small_fills_the_rest_and_keeps_the_connection(connect):
    conn = connect()
    keys = keys_for(f"small-{connect.transport}", 3)
    values = [value(f"small-{connect.transport}-{i}", 20 * KiB) for i in range(3)]
    conn.put_many(list(zip(keys, values)))
    buffers = [bytearray(20 * KiB), bytearray(10 * KiB), bytearray(20 * KiB)]
    with pytest.raises(BufferTooSmall) as info:
        conn.get_into_many(keys, buffers)
    assert info.value.needed == 20 * KiB
    assert bytes(buffers[0]) == values[0] and bytes(buffers[2]) == values[2]
    with pytest.raises(BufferTooSmall):
        conn.get_into(keys[1], buffers[1])
    assert conn.get_many(keys) == values


def test_invalid_values_are_typed_and_the_connection_keeps_working(connect):
    conn = connect()
    keys = keys_for(f"invalid-{connect.transport}", 3)
    results = conn.put_many([(keys[0], b"a" * (MAX_BLOCK + 1)), (keys[1], b""), (keys[2], b"ok")])
    assert [type(r) for r in results] == [InvalidValue, InvalidValue, type(None)]
    with pytest.raises(InvalidValue):
        conn.put(keys[0], np.zeros(MAX_BLOCK + 1, dtype=np.uint8))
    conn.ping()
    assert conn.get_many(keys) == [None, None, b"ok"]


def test_unknown_namespace_and_invalid_keys(connect):
    conn = connect()
    stranger = keys_for("stranger", 1, namespace="nope")[0]
    good = keys_for(f"ns-{connect.transport}", 1, namespace="other")[0]
    results = conn.put_many([(stranger, b"v"), (good, b"w")])
    assert type(results[0]) is UnknownNamespace and results[1] is None
    with pytest.raises(UnknownNamespace):
        conn.get_many([good, stranger])
    with pytest.raises(UnknownNamespace):
        conn.exists_many([stranger])
    with pytest.raises(InvalidKey):
        conn.get_many([("ns", b"")])
    assert type(conn.put_many([(("", b"d"), b"v")])[0]) is InvalidKey
    assert conn.get(good) == b"w"


def test_ssd_resident_blocks_are_read_over_every_transport(connect, node):
    conn = connect()
    tag = f"ssd-{connect.transport}"
    keys = keys_for(tag, 40)
    values = [value(f"{tag}-{i}", MiB) for i in range(40)]  # 40 MiB through a 24 MiB DRAM tier
    assert conn.put_many(list(zip(keys, values))) == [None] * 40
    if node.store is not None:
        deadline = time.monotonic() + 5
        while node.store.tier_of(keys[0]) != "ssd" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert node.store.tier_of(keys[0]) == "ssd"
    assert conn.get_many(keys[:4]) == values[:4]
    buffers = [bytearray(MiB) for _ in range(8)]
    assert conn.get_into_many(keys[4:12], buffers) == [MiB] * 8
    assert [bytes(b) for b in buffers] == values[4:12]
    assert conn.get_into(keys[12], buffers[0]) == MiB and bytes(buffers[0]) == values[12]


def test_reads_are_exact_under_concurrent_overwrites(connect):
    reader, writer = connect(), connect()
    keys = keys_for(f"race-{connect.transport}", 6)
    size = 256 * KiB

    def version(k: int, v: int) -> bytes:
        return v.to_bytes(8, "little") + value(f"race-{k}-{v % 5}", size - 8)

    writer.put_many([(k, version(i, 0)) for i, k in enumerate(keys)])
    stop, failures = threading.Event(), []

    def write() -> None:
        v = 1
        churn = keys_for(f"churn-{connect.transport}", 16)
        while not stop.is_set():
            writer.put_many([(k, version(i, v)) for i, k in enumerate(keys)])
            writer.put_many([(churn[v % 16], value("churn", MiB))])  # keeps the evictor busy
            v += 1

    thread = threading.Thread(target=write)
    thread.start()
    try:
        buffers = [bytearray(size) for _ in keys]
        for _ in range(60):
            assert reader.get_into_many(keys, buffers) == [size] * len(keys)
            for i, data in enumerate(reader.get_many(keys) + [bytes(b) for b in buffers]):
                k = i % len(keys)
                if data != version(k, int.from_bytes(data[:8], "little")):
                    failures.append((k, data[:8]))
    finally:
        stop.set()
        thread.join()
    assert not failures


def test_leased_blocks_stay_put_while_others_write(shm_connect, node):
    conn, writer = shm_connect(), shm_connect()
    key = keys_for("leased", 1)[0]
    original = value("leased", 2 * MiB)
    writer.put(key, original)
    with conn.lease_many([key, keys_for("leased-miss", 1)[0]]) as lease:
        view, missing = lease.views
        assert missing is None and view.readonly and bytes(view) == original
        writer.put(key, b"replaced")
        flood = keys_for("flood", 40)
        assert writer.put_many([(k, value("flood", MiB)) for k in flood]) == [None] * 40  # > DRAM
        if node.store is not None:
            assert node.store.stats()["dram"]["evictions"] + node.store.stats()["dram"]["demotions"] > 0
        assert bytes(view) == original  # neither evicted nor overwritten while leased
        del view, missing
    assert conn.get(key) == b"replaced"


def test_info_describes_the_node(connect):
    info = connect().info()
    assert info["max_block_bytes"] == MAX_BLOCK and info["max_frame_bytes"] == MAX_FRAME
    assert info["arena"] and info["machine_id"] and info["version"] == 1


def test_puts_not_waited_for_store_what_the_buffers_held_and_are_read_back(connect):
    """wait=False returns once the bytes are on their way: the caller reuses its buffer at
    once; the connection's next read sees every such put (replies read in order first)."""
    conn = connect()
    sizes = [64 * KiB] * 12 + [3 * KiB, MiB + 3] + [64 * KiB] * 4  # same sizes in a row, then others
    keys = keys_for(f"nowait-{connect.transport}", len(sizes))
    values = [value(f"nowait-{connect.transport}-{i}", s) for i, s in enumerate(sizes)]
    scratch = bytearray(max(sizes))
    for k, v in zip(keys, values):
        scratch[: len(v)] = v
        assert conn.put_many([(k, memoryview(scratch)[: len(v)])], wait=False) == [None]
        scratch[: len(v)] = bytes(len(v))  # reused at once: must not change what was stored
    assert conn.get(keys[-1]) == values[-1]  # the first read answers every put before it
    assert conn.get_many(keys) == values
    assert conn.put_failures == []


def test_refusals_of_puts_not_waited_for_are_reported_once(connect):
    conn = connect()
    good = keys_for(f"nowait-ok-{connect.transport}", 6)
    bad = keys_for(f"nowait-bad-{connect.transport}", 3, namespace="undeclared")
    items = [(k, value(f"n{i}", 4 * KiB)) for i, k in enumerate(good[:3] + bad + good[3:])]
    returned = []
    for item in items:
        returned += conn.put_many([item], wait=False)
    conn.flush()
    refused = {items[i][0]: e for i, e in enumerate(returned) if e is not None}
    refused.update(conn.put_failures)
    assert len(refused) == len([e for e in returned if e is not None]) + len(conn.put_failures)  # each once
    assert set(refused) == set(bad) and all(isinstance(e, UnknownNamespace) for e in refused.values())
    assert conn.get_many(good) == [v for k, v in items if k in good]
