"""A node's block events reach a real master's index: a lone block or a burst as soon as it
ends, not at the end of the flush interval; never more than one report every _MIN_GAP_S."""

from __future__ import annotations

import time

import pytest

from bench.common import wait_until
from kvstore.master.server import MasterServer
from kvstore.node.master_agent import _MIN_GAP_S, MasterAgent
from kvstore.node.store import BlockStore, StoreConfig
from kvstore_client.proto import kvstore_pb2 as pb

KiB = 1024
INTERVAL = 2.0  # long, so that "when the burst ends" and "at the end of the interval" are far apart


@pytest.fixture
def pool(tmp_path):
    store = BlockStore(StoreConfig(dram_capacity=16384 * KiB, max_block_bytes=4 * KiB, background_eviction=False))
    master = MasterServer(port=0, ttl_s=30.0).start()
    info = pb.NodeInfo(node_id="n1", host="h", machine_id="m", data_address="h:7000")
    agent = MasterAgent(master.address, info, store, flush_interval=INTERVAL).start()
    assert agent.wait_registered(10)
    yield store, master, agent
    agent.stop()
    master.stop(grace=0)
    store.close()


def indexed(master, key) -> bool:
    return bool(master.index.locate(key[0], [key[1]])[0])


def test_a_block_stored_alone_is_indexed_at_once(pool):
    store, master, _ = pool
    for i in range(2):  # twice: a fixed-period flush would be this quick now and then by chance
        time.sleep(INTERVAL * 1.2)
        key = ("quiet", i.to_bytes(16, "big"))
        started = time.monotonic()
        store.put(key, bytes(KiB))
        wait_until(lambda: indexed(master, key), timeout=INTERVAL * 3, interval=0.005)
        assert time.monotonic() - started < INTERVAL / 2


def test_a_burst_is_indexed_when_it_ends_in_few_reports(pool):
    """2,000 puts back to back, then nothing: all in the index well before the flush interval
    ends, in no more reports than one every _MIN_GAP_S (the most any pattern of events costs)."""
    store, master, agent = pool
    time.sleep(INTERVAL * 1.2)
    before, started = agent.reports_sent, time.monotonic()
    keys = [("burst", i.to_bytes(16, "big")) for i in range(2000)]
    for key in keys:
        store.put(key, bytes(KiB))
    wait_until(lambda: all(indexed(master, k) for k in keys[-10:]), timeout=INTERVAL * 3, interval=0.005)
    elapsed = time.monotonic() - started
    assert elapsed < INTERVAL / 2
    assert all(indexed(master, k) for k in keys)
    assert 1 <= agent.reports_sent - before <= elapsed / _MIN_GAP_S + 2
