"""A storage node's start-up against its master: in this process, on real loopback ports."""

from __future__ import annotations

from kvstore.benchmark.baselines import free_port
from kvstore.master.server import MasterServer
from kvstore.node.config import StoreConfig
from kvstore.node.daemon import NodeOptions, StorageNode
from kvstore_client.slices import value_checksum
from kvstore_client.transport import TcpConnection


def small_node(master: str, tmp_path, wait: float = 5.0) -> StorageNode:
    return StorageNode(
        StoreConfig(dram_capacity=4 << 20, max_block_bytes=1 << 20),
        NodeOptions(master=master, data_dir=str(tmp_path), register_wait_s=wait),
    ).start()


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


def test_sockets_of_killed_nodes_are_reaped_and_live_ones_kept(tmp_path):
    import os
    import socket

    from kvstore.node.daemon import reap_stale_sockets

    def bound(name: str, listen: bool) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(tmp_path / name))
        if listen:
            sock.listen(1)
        return sock

    dead, young = bound("kvstore-dead.sock", listen=False), bound("kvstore-young.sock", listen=False)
    live = bound("kvstore-live.sock", listen=True)
    dead.close()  # its file stays, as after kill -9
    young.close()
    (tmp_path / "kvstore-file.sock").write_bytes(b"not a socket")
    (tmp_path / "other.sock").touch()
    for name in ("kvstore-dead.sock", "kvstore-live.sock", "kvstore-file.sock"):
        os.utime(tmp_path / name, (1, 1))  # long ago
    try:
        assert reap_stale_sockets(str(tmp_path)) == ["kvstore-dead.sock"]
        assert sorted(os.listdir(tmp_path)) == [
            "kvstore-file.sock",
            "kvstore-live.sock",
            "kvstore-young.sock",
            "other.sock",
        ]
    finally:
        live.close()


def test_a_node_whose_ssd_file_is_cut_short_says_so_and_starts_only_when_told_to_set_it_aside(tmp_path):
    import os

    import pytest

    from kvstore.tiers.ssd import SsdTier
    from tests.processes import start_master, start_node

    tier = SsdTier(str(tmp_path / "ssd"), 64 << 20)
    for i in range(50):
        block = os.urandom(64 << 10)
        tier.put(("ns", i.to_bytes(16, "little")), block, value_checksum(block))
    tier.close()
    data = tmp_path / "ssd" / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)
    master = start_master()
    try:
        with pytest.raises(RuntimeError) as refused:
            start_node(master.record["master"], tmp_path)
        assert "is truncated" in str(refused.value) and "--ssd-damaged move-aside" in str(refused.value)
        assert "Traceback" not in str(refused.value)
        node = start_node(master.record["master"], tmp_path, extra=("--ssd-damaged", "move-aside"))
        try:
            assert node.proc.poll() is None
            assert any(name.startswith("data.mdb.damaged-") for name in os.listdir(tmp_path / "ssd"))
        finally:
            node.close()
    finally:
        master.close()
