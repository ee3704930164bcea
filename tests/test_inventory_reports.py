"""A node's full inventory, sent packed (to a master that reads PackedBlocks) or as STORED
events (to one that does not), indexes the same blocks in the same tiers at a real master."""

from __future__ import annotations

import grpc
import pytest

from kvstore.master.server import MasterServer
from kvstore.node.master_agent import event_reports, packed_reports
from kvstore.node.store import BlockStore, StoreConfig
from kvstore_client.proto import kvstore_pb2 as pb
from kvstore_client.proto import kvstore_pb2_grpc as pb_grpc

KiB = 1024


@pytest.fixture
def store(tmp_path):
    store = BlockStore(
        StoreConfig(
            dram_capacity=64 * KiB,
            max_block_bytes=4 * KiB,
            ssd_path=str(tmp_path / "ssd"),
            ssd_capacity=1024 * KiB,
            policy="lru",
            background_eviction=False,
        )
    )
    for i in range(100):  # 64 KiB of DRAM holds 16 of these: the rest are demoted to SSD
        store.put(("llama/a" if i % 3 else "other", i.to_bytes(1 + i % 20, "big")), bytes(4 * KiB))
    yield store
    store.close()


def indexed(form: str, store: BlockStore) -> tuple[dict, list]:
    with MasterServer(port=0, ttl_s=30.0) as master, grpc.insecure_channel(master.address) as channel:
        stub = pb_grpc.MasterStub(channel)
        info = pb.NodeInfo(node_id="n1", host="h", machine_id="m", data_address="h:7000")
        stub.Register(pb.RegisterRequest(info=info))
        reports = list((packed_reports if form == "packed" else event_reports)("n1", store.inventory()))
        assert reports[0].full_inventory and not any(r.full_inventory for r in reports[1:])
        assert all(bool(r.packed) == (form == "packed") for r in reports)
        for report in reports:
            assert stub.ReportBlocks(report).known
        keys = master.index.list_keys(None, 1000)
        return master.index.node_counts(), keys


def test_packed_and_event_inventories_index_the_same_blocks(store):
    counts, keys = indexed("packed", store)
    assert (counts, keys) == indexed("events", store)
    assert counts["n1"]["dram"] > 0 and counts["n1"]["ssd"] > 0
    assert len(keys) == 100


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_inventory_taken_while_the_master_is_away_and_the_changes_after_it_both_reach_the_new_master(store):
    """The agent snapshots its inventory once the master stops answering, before one is back;
    blocks put and removed after that snapshot still end up exactly right in the new master's index."""
    from kvstore.node.master_agent import MasterAgent
    from bench.common import wait_until

    port = free_port()
    info = pb.NodeInfo(node_id="n1", host="h", machine_id="m", data_address="h:7000")
    first = MasterServer(port=port, ttl_s=30.0).start()
    agent = MasterAgent(first.address, info, store, flush_interval=0.02).start()
    try:
        assert agent.wait_registered(10)
        first.stop(grace=0)
        wait_until(lambda: agent.inventory_waiting is not None, timeout=10)
        assert agent.inventory_waiting == 100 and not agent.registered
        for i in range(100, 110):  # after the snapshot, while no master answers
            store.put(("other", i.to_bytes(4, "big")), bytes(KiB))
        for i in range(0, 100, 10):
            store.remove(("llama/a" if i % 3 else "other", i.to_bytes(1 + i % 20, "big")))
        with MasterServer(port=port, ttl_s=30.0) as second:
            assert agent.wait_registered(10)
            want = sorted((ns, dg) for ns, dg in (k for k, _ in store.inventory()))

            def indexed():
                return sorted((ns, dg) for ns, dg, _ in second.index.list_keys(None, 1000))

            wait_until(lambda: indexed() == want, timeout=10)
            assert len(want) == 100 and agent.inventory_waiting is None
    finally:
        agent.stop()
        first.stop(grace=0)
