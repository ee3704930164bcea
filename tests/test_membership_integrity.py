"""Membership integrity: node ids bound to their registrant, one process per data dir, PULL only
to registered nodes, private file modes, and a demo that keeps off the service's data dir.

Real master and node processes (tests.processes) where the claim is about processes; in-process
nodes on real loopback ports where the test needs to look inside one.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys

import grpc
import pytest

from kvstore.master.credentials import node_metadata
from kvstore.master.server import MasterServer
from kvstore.node.config import StoreConfig
from kvstore.node.daemon import NodeOptions, StorageNode
from kvstore.node.data_dir_lock import DataDirInUse
from kvstore.node.peers import RegisteredPeers
from kvstore_client import BlockHasher, Client
from kvstore_client.errors import ServiceUnavailable
from kvstore_client.proto import kvstore_pb2 as pb
from kvstore_client.proto import kvstore_pb2_grpc as pb_grpc
from kvstore_client.transport import TcpConnection
from tests.conftest import value_for
from tests.processes import ROOT, start_master, start_node, wait_for

KiB, MiB = 1 << 10, 1 << 20


def keys_of(n: int, ns: str = "integrity"):
    return BlockHasher(ns, 4).keys(list(range(4 * n)))


def node_status(stub, node_id: str) -> pb.NodeStatus:
    return next(n for n in stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=10).nodes if n.info.node_id == node_id)


# -- a live node's id cannot be taken over ----------------------------------------------------------


def test_a_forged_register_of_a_live_node_is_refused_and_changes_nothing(tmp_path):
    master = start_master(ttl=30.0)  # a long lease: the real node stays live throughout
    node = start_node(master.record["master"], tmp_path / "n", dram="8MiB", ssd="0")
    node_id, keys = node.record["node_id"], keys_of(6)
    try:
        with Client(master.record["master"], prefer_shm=False, location_ttl=0) as client:
            client.batch_put(keys, [value_for(k, 4 * KiB) for k in keys])
            wait_for(lambda: all(client.batch_exists(keys)), timeout=30)
        with grpc.insecure_channel(master.record["master"]) as channel:
            stub = pb_grpc.MasterStub(channel)
            before = node_status(stub, node_id)
            assert before.indexed_blocks == len(keys)
            forged = pb.NodeInfo(node_id=node_id, data_address="127.0.0.1:9", machine_id="elsewhere")
            for metadata in (None, node_metadata("guessed-incarnation")):
                with pytest.raises(grpc.RpcError) as err:
                    stub.Register(pb.RegisterRequest(info=forged), timeout=10, metadata=metadata)
                assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
                assert node_id in err.value.details()
            with pytest.raises(grpc.RpcError) as err:  # nor may it speak for the node
                stub.ReportBlocks(pb.BlockReport(node_id=node_id, full_inventory=True), timeout=10)
            assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
            with pytest.raises(grpc.RpcError) as err:
                stub.Heartbeat(pb.HeartbeatRequest(node_id=node_id), timeout=10)
            assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
            after = node_status(stub, node_id)
            assert after.info == before.info and after.alive
            assert after.indexed_blocks == len(keys)
        with Client(master.record["master"], prefer_shm=False, location_ttl=0) as client:
            assert all(client.batch_exists(keys))
            assert client.batch_get(keys) == [value_for(k, 4 * KiB) for k in keys]
    finally:
        node.close()
        master.close()


# -- one process per data dir -----------------------------------------------------------------------


def test_a_second_node_on_a_data_dir_fails_naming_the_holder(tmp_path):
    master = start_master(ttl=30.0)
    first = start_node(master.record["master"], tmp_path / "n", dram="8MiB", ssd="8MiB")
    try:
        with Client(master.record["master"], prefer_shm=False, location_ttl=0) as client:
            keys = keys_of(3)
            client.batch_put(keys, [value_for(k, 4 * KiB) for k in keys])
            wait_for(lambda: all(client.batch_exists(keys)), timeout=30)
            with pytest.raises(RuntimeError) as err:
                start_node(master.record["master"], tmp_path / "n", dram="8MiB", ssd="8MiB")
            message = str(err.value)
            assert f"pid {first.proc.pid}" in message and "DataDirInUse" in message
            assert "Traceback" not in message
            assert first.proc.poll() is None
            assert all(client.batch_exists(keys))  # the first node's blocks are still indexed
    finally:
        first.close()
        master.close()


def test_the_data_dir_lock_is_per_process_lifetime_and_freed_by_stop(tmp_path):
    config = StoreConfig(dram_capacity=4 * MiB, max_block_bytes=MiB)
    node = StorageNode(config, NodeOptions(data_dir=str(tmp_path), unix_socket=False)).start()
    try:
        with pytest.raises(DataDirInUse, match=f"pid {os.getpid()}"):
            StorageNode(config, NodeOptions(data_dir=str(tmp_path), unix_socket=False)).start()
    finally:
        node.stop()
    StorageNode(config, NodeOptions(data_dir=str(tmp_path), unix_socket=False)).start().stop()  # free again


def test_the_demo_leaves_the_service_data_dir_alone(tmp_path):
    service_dir = tmp_path / "kvstore-data"  # the service's default data dir, relative to where it runs
    (service_dir / "ssd").mkdir(parents=True)
    (service_dir / "node_id").write_text("node-service\n")
    before = sorted(str(p.relative_to(service_dir)) for p in service_dir.rglob("*"))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore.cli",
            "demo",
            "--dram",
            "4MiB",
            "--ssd",
            "8MiB",
            "--blocks",
            "8",
            "--block-size",
            "256KiB",
            "--json",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert result.returncode == 0, result.stderr
    assert sorted(str(p.relative_to(service_dir)) for p in service_dir.rglob("*")) == before
    assert sorted(os.listdir(tmp_path)) == ["kvstore-data"]  # and left nothing else behind here


# -- PULL goes only to registered nodes -------------------------------------------------------------


@pytest.fixture
def pool():
    """An in-process master and two in-process nodes registered with it."""
    master = MasterServer(port=0, ttl_s=30.0, heartbeat_interval_s=0.5).start()
    config = StoreConfig(dram_capacity=8 * MiB, max_block_bytes=MiB)
    nodes = [StorageNode(config, NodeOptions(master=master.address, unix_socket=False)).start() for _ in range(2)]
    yield master, nodes
    for node in nodes:
        node.stop()
    master.stop()


def test_pull_from_an_unregistered_address_is_refused_without_dialling(pool):
    _, (target, _) = pool
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(1.0)
    address = "%s:%d" % listener.getsockname()
    key = keys_of(1)[0]
    try:
        with TcpConnection(target.server.address) as conn:
            with pytest.raises(ServiceUnavailable):
                conn.pull_many(address, [(key, 0)])
        with pytest.raises(socket.timeout):  # nothing dialled the test's socket
            listener.accept()
        assert not target.store.exists(key)
    finally:
        listener.close()


def test_pull_from_a_registered_node_still_copies(pool):
    _, (target, source) = pool
    keys = keys_of(4, ns="pulled")
    for depth, k in enumerate(keys):
        source.store.put(k, value_for(k, 64 * KiB), depth=depth)
    with TcpConnection(target.server.address) as conn:
        assert conn.pull_many(source.data_address(), [(k, d) for d, k in enumerate(keys)]) == [True] * len(keys)
    assert [target.store.get(k) for k in keys] == [value_for(k, 64 * KiB) for k in keys]


def test_a_node_without_a_master_pulls_from_nobody(tmp_path):
    source = StorageNode(StoreConfig(dram_capacity=4 * MiB, max_block_bytes=MiB), NodeOptions(unix_socket=False))
    target = StorageNode(StoreConfig(dram_capacity=4 * MiB, max_block_bytes=MiB), NodeOptions(unix_socket=False))
    source.start(), target.start()
    try:
        key = keys_of(1)[0]
        source.store.put(key, b"x" * 100)
        with TcpConnection(target.server.address) as conn, pytest.raises(ServiceUnavailable):
            conn.pull_many(source.data_address(), [(key, 0)])
        assert not target.store.exists(key)
    finally:
        target.stop()
        source.stop()


def test_registered_peers_refresh_on_a_miss_and_fail_closed():
    class Clock:
        now = 0.0

        def __call__(self):
            return self.now

    clock, listed, calls = Clock(), {"h:1"}, []

    def fetch():
        calls.append(clock.now)
        if listed is None:
            raise ConnectionError("master down")
        return set(listed)

    peers = RegisteredPeers(fetch, max_age_s=2.0, min_refresh_s=0.25, clock=clock)
    assert peers.allows("h:1") and not peers.allows("h:2")
    assert len(calls) == 1  # the miss came too soon after the fetch to ask again
    listed.add("h:2")
    clock.now = 0.3
    assert peers.allows("h:2") and len(calls) == 2  # a miss asks again
    listed = None
    clock.now = 1.0
    assert peers.allows("h:1")  # still fresh
    clock.now = 5.0
    assert not peers.allows("h:1")  # stale and the master cannot say: refused


# -- private files ------------------------------------------------------------------------------------


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_node_files_are_0600_in_0700_directories(tmp_path):
    data_dir = tmp_path / "data"
    config = StoreConfig(
        dram_capacity=4 * MiB, max_block_bytes=MiB, ssd_path=str(data_dir / "ssd"), ssd_capacity=8 * MiB
    )
    node = StorageNode(config, NodeOptions(data_dir=str(data_dir))).start()
    try:
        node.store.put(keys_of(1)[0], b"x" * 1000)
        arena = node.store.dram.arena
        assert mode(data_dir) == 0o700 and mode(data_dir / "ssd") == 0o700
        files = [
            data_dir / "node_id",
            data_dir / "lock",
            data_dir / "ssd" / "data.mdb",
            data_dir / "ssd" / "lock.mdb",
            arena.path,
            node.server.unix_path,
        ]
        if node.store.dram.directory is not None:
            files.append(node.store.dram.directory.path)
        assert {str(f): mode(f) for f in files} == {str(f): 0o600 for f in files}
    finally:
        node.stop()


def test_files_of_an_older_run_are_tightened(tmp_path):
    ssd = tmp_path / "data" / "ssd"
    config = StoreConfig(dram_capacity=4 * MiB, max_block_bytes=MiB, ssd_path=str(ssd), ssd_capacity=8 * MiB)
    StorageNode(config, NodeOptions(data_dir=str(tmp_path / "data"), unix_socket=False)).start().stop()
    for path, loose in ((tmp_path / "data", 0o755), (ssd, 0o755), (ssd / "data.mdb", 0o644)):
        os.chmod(path, loose)
    StorageNode(config, NodeOptions(data_dir=str(tmp_path / "data"), unix_socket=False)).start().stop()
    assert (mode(tmp_path / "data"), mode(ssd), mode(ssd / "data.mdb")) == (0o700, 0o700, 0o600)
