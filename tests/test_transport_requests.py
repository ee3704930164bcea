"""A frame is one request to the store: the blocks a PUT writes are not evicted to make
room for the rest of that frame (Mooncake, 3.2.1), whatever other clients read meanwhile,
under every eviction policy."""

from __future__ import annotations

import socket

import pytest
import xxhash

from kvstore.node.config import StoreConfig
from kvstore.node.store import BlockStore
from kvstore.transport.server import DataPlaneServer
from kvstore_client.transport import TcpConnection
from kvstore_client.wire import HEADER_SIZE, Op, pack_header, put_entry, unpack_header
from processes import recv_exact, wait_for

MiB = 1 << 20


@pytest.mark.parametrize("policy", ["lru", "lfu", "length_aware"])
def test_a_put_frame_keeps_its_own_fresh_blocks_while_others_read(policy):
    store = BlockStore(
        StoreConfig(dram_capacity=4 * MiB, max_block_bytes=MiB, policy=policy, granule=MiB, background_eviction=False)
    )
    server = DataPlaneServer(store).start()
    try:
        reader = TcpConnection(server.address)
        old = [("ns", b"old%d" % i) for i in range(4)]
        reader.put_many([(key, b"o" * MiB, depth) for depth, key in enumerate(old)])

        def read(keys) -> None:
            reader.get_many(keys)
            reader.ping()  # the node releases a read's leases after its reply: once it answers this, it has

        read(old)  # read once: hits the frame's fresh blocks do not have
        fresh = [("ns", b"new%d" % i) for i in range(3)]
        values = [bytes([i + 1]) * MiB for i in range(3)]
        table = b"".join(
            put_entry(k, depth, MiB, xxhash.xxh3_64_intdigest(v)) for depth, (k, v) in enumerate(zip(fresh, values))
        )
        host, port = server.address.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as writer:
            writer.sendall(pack_header(Op.PUT, 7, 3, len(table) + 3 * MiB) + table)
            for k, v in zip(fresh, values):  # one payload at a time, the old blocks read in between
                writer.sendall(v)
                assert wait_for(lambda: store.exists(k))
                read([o for o in old if store.tier_of(o) == "dram"])
            op, status, _, request_id, count, body_len = unpack_header(recv_exact(writer, HEADER_SIZE))
            assert (op, status, request_id, count) == (Op.PUT, 0, 7, 3)
            assert recv_exact(writer, body_len) == bytes(3)
        assert [store.tier_of(k) for k in fresh] == ["dram"] * 3
        assert reader.get_many(fresh) == values
        reader.close()
    finally:
        server.stop()
        store.close()
