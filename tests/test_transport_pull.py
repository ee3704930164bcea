"""PULL: a node copies blocks from another node's data plane into its own DRAM, node to node.

Real nodes in this process (a store and a data-plane server each) for the
copies; for the faults, a fake source on a real socket that speaks just
enough of the protocol to send a damaged block or to die mid-block.
"""

from __future__ import annotations

import json
import socket
import threading

import pytest
import xxhash

from kvstore.node.config import StoreConfig
from kvstore.node.store import BlockStore
from kvstore.transport.server import DataPlaneServer
from kvstore_client.errors import ChecksumMismatch, ServiceUnavailable
from kvstore_client.transport import TcpConnection
from kvstore_client.wire import FLAG_REPLY, GET_ITEM, HEADER_SIZE, Op, Status, pack_header, unpack_header
from tests.conftest import value_for

KiB, MiB = 1 << 10, 1 << 20


def keys_of(tag: str, n: int) -> list:
    return [("ns", xxhash.xxh3_128_digest(f"{tag}/{i}".encode())) for i in range(n)]


@pytest.fixture
def make_node():
    started = []

    def make() -> DataPlaneServer:
        store = BlockStore(StoreConfig(dram_capacity=32 * MiB, max_block_bytes=4 * MiB))
        started.append(DataPlaneServer(store, max_frame_bytes=8 * MiB).start())
        started[-1].puller.sources = lambda address: True  # no master here: any source (the check: below)
        return started[-1]

    yield make
    for server in started:
        server.stop()
        server.store.close()


def test_pull_copies_blocks_node_to_node(make_node):
    source, target = make_node(), make_node()
    keys = keys_of("copy", 12)
    values = [value_for(k, s) for k, s in zip(keys, [1, 4095, 64 * KiB, 3 * MiB + 5] * 3)]  # 3 frames' worth
    for depth, (k, v) in enumerate(zip(keys, values)):
        source.store.put(k, v, depth=depth)
    missing = keys_of("missing", 1)[0]
    with TcpConnection(target.address) as conn:
        copied = conn.pull_many(source.address, [(k, 100 + d) for d, k in enumerate(keys)] + [(missing, 0)])
    assert copied == [True] * len(keys) + [False]
    assert [target.store.get(k) for k in keys] == values
    assert target.store.describe(keys[3]).depth == 103  # depths come from the request
    assert not target.store.exists(missing)


def test_a_kept_connection_that_broke_is_replaced(make_node):
    source, target = make_node(), make_node()
    keys = keys_of("redial", 2)
    for k in keys:
        source.store.put(k, value_for(k, 4 * KiB))
    with TcpConnection(target.address) as conn:
        assert conn.pull_many(source.address, [(keys[0], 0)]) == [True]
        (kept,) = target.puller._idle[source.address]
        kept._sock.close()  # as if the source had restarted since
        assert conn.pull_many(source.address, [(keys[1], 0)]) == [True]
    assert target.store.get(keys[1]) == value_for(keys[1], 4 * KiB)


def test_pull_from_an_unreachable_source_stores_nothing(make_node):
    target = make_node()
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    address = "%s:%d" % dead.getsockname()
    dead.close()  # nothing listens there now
    with TcpConnection(target.address) as conn, pytest.raises(ServiceUnavailable):
        conn.pull_many(address, [(k, 0) for k in keys_of("unreachable", 3)])
    assert len(target.store) == 0 and target.store.dram.used_bytes == 0


class FakeSource:
    """Answers INFO, then answers each GET with one block of ``size`` bytes announced with
    ``checksum`` and sends ``sent`` of them, closing the connection when ``sent < size``."""

    def __init__(self, size: int, sent: int, checksum: int):
        self.size, self.sent, self.checksum = size, sent, checksum
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = "%s:%d" % self.listener.getsockname()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            with sock:
                self._answer(sock)

    def _answer(self, sock: socket.socket) -> None:
        while True:
            head = sock.recv(HEADER_SIZE, socket.MSG_WAITALL)
            if len(head) < HEADER_SIZE:
                return
            op, _, _, request_id, count, body_len = unpack_header(head)
            sock.recv(body_len, socket.MSG_WAITALL)
            if op == Op.INFO:
                info = {"max_frame_bytes": 8 * MiB, "max_block_bytes": 4 * MiB, "max_items": 65536}
                body = json.dumps(info).encode()
                sock.sendall(pack_header(op, request_id, 0, len(body), flags=FLAG_REPLY) + body)
                continue
            table = GET_ITEM.pack(Status.OK, self.size, self.checksum)
            table += GET_ITEM.pack(Status.NOT_FOUND, 0, 0) * (count - 1)
            sock.sendall(pack_header(op, request_id, count, len(table) + self.size, flags=FLAG_REPLY) + table)
            sock.sendall(bytes(self.sent))
            if self.sent < self.size:
                return  # dies mid-block

    def close(self) -> None:
        self.listener.close()


@pytest.mark.parametrize("fault", ["dies mid-block", "damaged block"])
def test_a_source_failing_mid_copy_leaves_nothing_half_copied(make_node, fault):
    target = make_node()
    size = 256 * KiB
    if fault == "dies mid-block":
        checksum = xxhash.xxh3_64_intdigest(bytes(size))
        source, error = FakeSource(size, sent=size // 3, checksum=checksum), ServiceUnavailable
    else:
        source, error = FakeSource(size, sent=size, checksum=12345), ChecksumMismatch
    try:
        with TcpConnection(target.address) as conn:
            with pytest.raises(error):
                conn.pull_many(source.address, [(k, 0) for k in keys_of("faulty", 2)])
            conn.ping()  # the target node still serves this connection
    finally:
        source.close()
    assert len(target.store) == 0
    assert target.store.dram.used_bytes == 0  # the reservation was revoked
