"""Draining a live node (``kvstore drain``): no new placements on it, the blocks only it holds
are copied to other nodes, then all of its blocks leave the index, and every block still
reads back exactly; ``--cancel`` puts it back in service."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvstore.master.server import MasterServer
from kvstore.node.config import StoreConfig
from kvstore.node.daemon import NodeOptions, StorageNode
from kvstore_client import Client
from processes import ROOT, wait_for

MiB = 1 << 20
NS = "drain"


def value(i: int) -> bytes:
    return i.to_bytes(4, "big") * 256


@pytest.fixture
def pool():
    master = MasterServer(port=0, ttl_s=60.0, heartbeat_interval_s=0.5).start()
    nodes = [
        StorageNode(
            StoreConfig(dram_capacity=16 * MiB, max_block_bytes=MiB), NodeOptions(master=master.address)
        ).start()
        for _ in range(3)
    ]
    yield master, nodes
    for node in nodes:
        node.stop()
    master.stop()


def test_a_drained_node_hands_its_only_copies_over_and_takes_no_placements(pool):
    master, (leaving, other, third) = pool
    only_here = [(NS, b"only-%d" % i) for i in range(150)]
    shared = [(NS, b"shared-%d" % i) for i in range(20)]
    for i, key in enumerate(only_here):
        leaving.store.put(key, value(i))
    for i, key in enumerate(shared):
        leaving.store.put(key, value(1000 + i))
        other.store.put(key, value(1000 + i))
    wait_for(lambda: master.index.size() == 170 and master.index.node_blocks(other.node_id) == 20)
    with Client(master.address) as client:
        reply = client.drain(leaving.node_id)
        assert (reply.known, reply.indexed_blocks, reply.copying) == (True, 170, 150)
        assert master.drainer.wait(leaving.node_id, timeout=60)
        status = {n.info.node_id: n for n in client.cluster_status().nodes}
        assert status[leaving.node_id].draining and status[leaving.node_id].alive
        assert status[leaving.node_id].indexed_blocks == 0
        assert master.index.size() == 170  # every block still indexed, on the other nodes
        for i, key in enumerate(only_here):
            assert client.get(key) == value(i)
            assert other.store.exists(key) or third.store.exists(key)
        for i, key in enumerate(shared):
            assert client.get(key) == value(1000 + i)
        fresh = [(NS, b"after-%d" % i) for i in range(40)]
        client.batch_put(fresh, [value(i) for i in range(40)])
        assert not any(leaving.store.exists(key) for key in fresh)  # no placement on a draining node
        leaving.store.put((NS, b"written-anyway"), b"x" * 100)  # a writer with an old placement
        assert not wait_for_or_false(lambda: master.index.size() > 210, 1.0)  # not indexed while draining

        assert client.drain(leaving.node_id, cancel=True).known
        assert leaving.node_id in {s.node_id for s in master.membership.placeable_nodes()}
        assert not client.drain("node-nobody").known


def wait_for_or_false(predicate, timeout: float) -> bool:
    try:
        return bool(wait_for(predicate, timeout=timeout))
    except AssertionError:
        return False


def kvstore(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvstore.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_the_drain_command_waits_for_the_index_and_says_unknown_nodes_plainly(pool):
    master, (leaving, _other, _third) = pool
    for i in range(30):
        leaving.store.put((NS, b"cli-%d" % i), value(i))
    wait_for(lambda: master.index.size() == 30)
    done = kvstore("drain", leaving.node_id, "--master", master.address, "--wait", "60", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "node_id": leaving.node_id,
        "draining": True,
        "indexed_blocks": 30,
        "copying": 30,
        "drained": True,
    }
    assert master.index.node_blocks(leaving.node_id) == 0 and master.index.size() == 30
    unknown = kvstore("drain", "node-nobody", "--master", master.address)
    assert unknown.returncode == 1 and "knows no node 'node-nobody'" in unknown.stderr
    assert "Traceback" not in unknown.stderr


def test_a_drain_under_an_access_file_copies_blocks_node_to_node_with_node_tokens(tmp_path):
    """PULL under --auth: the target node checks the source against the master with its node
    token (Peers), so the copies land; a tenant's blocks read back exactly from the other node."""
    from kvstore_client.credentials import Credentials
    from tests.access_files import ADMIN, NODE, NS_A, TENANT_A, access_list

    access = access_list(tmp_path / "access")
    master = MasterServer(port=0, ttl_s=60.0, heartbeat_interval_s=0.5, access=access).start()
    nodes = [
        StorageNode(
            StoreConfig(dram_capacity=16 * MiB, max_block_bytes=MiB),
            NodeOptions(master=master.address, unix_socket=False, access=access, credentials=Credentials(NODE)),
        ).start()
        for _ in range(2)
    ]
    leaving, other = nodes
    try:
        keys = [(NS_A, b"pulled-%d" % i) for i in range(40)]
        for i, key in enumerate(keys):
            leaving.store.put(key, value(i))
        wait_for(lambda: master.index.size() == len(keys))
        with Client(master.address, token=ADMIN) as admin:
            assert admin.drain(leaving.node_id).copying == len(keys)
            assert master.drainer.wait(leaving.node_id, timeout=60)
        assert all(other.store.exists(key) for key in keys)
        with Client(master.address, token=TENANT_A, data_path="tcp", location_ttl=0) as tenant:
            assert tenant.batch_get(keys) == [value(i) for i in range(len(keys))]
    finally:
        for node in nodes:
            node.stop()
        master.stop()
