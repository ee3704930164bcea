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
