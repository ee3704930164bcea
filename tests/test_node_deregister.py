"""A node that stops cleanly leaves the pool at once: the master drops it and its blocks
(no waiting for its lease), and only the process that registered it may make it leave."""

from __future__ import annotations

import grpc
import pytest

from kvstore.master.credentials import node_metadata
from kvstore.master.server import MasterServer
from kvstore.node.config import StoreConfig
from kvstore.node.daemon import NodeOptions, StorageNode
from kvstore_client import Client
from kvstore_client.proto import kvstore_pb2 as pb
from kvstore_client.proto import kvstore_pb2_grpc as pb_grpc
from processes import wait_for

MiB = 1 << 20


@pytest.fixture
def master():
    server = MasterServer(port=0, ttl_s=60.0, heartbeat_interval_s=0.5).start()  # a lease far longer than the test
    yield server
    server.stop()


def start_node(master: MasterServer) -> StorageNode:
    return StorageNode(
        StoreConfig(dram_capacity=16 * MiB, max_block_bytes=MiB), NodeOptions(master=master.address)
    ).start()


def test_a_node_stopped_cleanly_leaves_with_its_blocks_at_once(master):
    leaving, staying = start_node(master), start_node(master)
    try:
        with Client(master.address) as client:
            leaving.store.put(("ns", b"on-the-leaving-node"), b"x" * 1000)
            assert wait_for(lambda: master.index.size() == 1)
            leaving.stop()
            ids = [n.info.node_id for n in client.cluster_status().nodes]
            assert ids == [staying.node_id] and master.index.size() == 0
            assert client.get(("ns", b"on-the-leaving-node")) is None  # a miss, not a dead node's address
            client.put(("ns", b"after"), b"y" * 1000)  # placed on the node that is left
            assert staying.store.get(("ns", b"after")) == b"y" * 1000
    finally:
        staying.stop()


def test_only_the_registrant_may_deregister_a_node(master):
    node = start_node(master)
    try:
        with grpc.insecure_channel(master.address) as channel:
            stub = pb_grpc.MasterStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Deregister(
                    pb.DeregisterRequest(node_id=node.node_id), metadata=node_metadata("forged"), timeout=10
                )
            assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
            assert master.membership.known(node.node_id)
            assert not stub.Deregister(pb.DeregisterRequest(node_id="node-nobody"), timeout=10).known
    finally:
        node.stop()
    assert not master.membership.known(node.node_id)
