"""A storage node's start-up against its master: in this process, on real loopback ports."""

from __future__ import annotations

from kvstore.benchmark.baselines import free_port
from kvstore.master.server import MasterServer
from kvstore.node.config import StoreConfig
from kvstore.node.daemon import NodeOptions, StorageNode
from kvstore_client.transport import TcpConnection


def small_node(master: str, tmp_path, wait: float = 5.0) -> StorageNode:
    return StorageNode(StoreConfig(dram_capacity=4 << 20, max_block_bytes=1 << 20),
                       NodeOptions(master=master, data_dir=str(tmp_path), register_wait_s=wait)).start()


def test_start_returns_once_the_master_knows_the_node(tmp_path):
    master = MasterServer(port=0, ttl_s=5.0, heartbeat_interval_s=0.5).start()
    node = small_node(master.address, tmp_path)
    try:
        assert node.agent.registered and master.membership.known(node.node_id)  # a client may place on it now
    finally:
        node.stop()
        master.stop()


def test_a_node_serves_before_its_master_is_up_and_registers_when_it_comes(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    node = small_node(address, tmp_path, wait=0.3)
    master = None
    try:
        assert not node.agent.registered
        with TcpConnection(node.server.address) as conn:  # serving meanwhile
            conn.put(("ns", b"k" * 16), b"early")
            assert conn.get(("ns", b"k" * 16)) == b"early"
        master = MasterServer(port=int(address.rsplit(":", 1)[1]), ttl_s=5.0, heartbeat_interval_s=0.5).start()
        assert node.agent.wait_registered(15)
        assert master.membership.known(node.node_id)
        assert master.index.size() == 1  # its inventory came with the registration
    finally:
        node.stop()
        if master is not None:
            master.stop()
