"""An idle node or master has no thread waking up to poll: the metrics exporter, the evictor and
the master agent sleep until there is work (a scrape, a tier over its high watermark, a block
event or a heartbeat), and still do it at once when it comes.

Each test counts the times the scheduler ran the thread (``/proc/self/task/<tid>/schedstat``)
while the component sat idle; the polling these replaced ran it 10 to 20 times a second."""

from __future__ import annotations

import threading
import time
import urllib.request

from bench.common import wait_until
from kvstore.master.server import MasterServer
from kvstore.metrics import MetricsServer
from kvstore.node.master_agent import MasterAgent
from kvstore.node.store import BlockStore, StoreConfig
from kvstore_client.proto import kvstore_pb2 as pb

KiB = 1024
IDLE_S = 1.5


def runs_while_idle(thread_name: str, seconds: float = IDLE_S) -> int:
    """How many times the scheduler put the thread named ``thread_name`` on a CPU in ``seconds``."""
    (thread,) = [t for t in threading.enumerate() if t.name == thread_name]

    def runs() -> int:
        with open(f"/proc/self/task/{thread.native_id}/schedstat") as f:
            return int(f.read().split()[2])

    before = runs()
    time.sleep(seconds)
    return runs() - before


def test_the_metrics_exporter_sleeps_until_scraped_and_stops_at_once():
    with MetricsServer(0, lambda: [("up", "Up.", "gauge", {}, 1)]) as server:
        time.sleep(0.2)  # past its start
        assert runs_while_idle("metrics-http") < 5
        with urllib.request.urlopen(f"http://{server.address}/metrics", timeout=5) as resp:
            assert resp.read().endswith(b"up 1\n")
        thread = next(t for t in threading.enumerate() if t.name == "metrics-http")
    assert not thread.is_alive()  # stop() woke and joined it


def test_the_evictor_sleeps_under_the_high_watermark_and_wakes_past_it():
    store = BlockStore(StoreConfig(dram_capacity=256 * KiB, max_block_bytes=4 * KiB))
    try:
        store.put(("ns", b"first"), bytes(4 * KiB))
        time.sleep(0.2)
        assert runs_while_idle("kvstore-evictor") < 5
        for i in range(63):  # 64 blocks of 4 KiB: 100% of DRAM, past the 95% high watermark
            store.put(("ns", i.to_bytes(8, "big")), bytes(4 * KiB))
        dram = lambda: store.stats()["dram"]  # noqa: E731
        wait_until(lambda: dram()["used"] <= 0.85 * dram()["capacity"], timeout=10)
        assert dram()["evictions"] > 0
        assert store.get(("ns", (62).to_bytes(8, "big"))) is not None  # LRU: the newest stays
    finally:
        store.close()


def test_the_master_agent_sleeps_between_heartbeats_and_wakes_for_an_event():
    store = BlockStore(StoreConfig(dram_capacity=1024 * KiB, max_block_bytes=4 * KiB, background_eviction=False))
    master = MasterServer(port=0, ttl_s=30.0).start()
    info = pb.NodeInfo(node_id="n1", host="h", machine_id="m", data_address="h:7000")
    agent = MasterAgent(master.address, info, store, flush_interval=0.05).start()
    try:
        assert agent.wait_registered(10)
        time.sleep(0.2)
        assert runs_while_idle("kvstore-master-agent") < 15  # its heartbeats only; polling ran it 30 times
        key = ("ns", bytes(16))
        store.put(key, bytes(KiB))
        wait_until(lambda: bool(master.index.locate(key[0], [key[1]])[0]), timeout=5, interval=0.005)
    finally:
        agent.stop()
        master.stop(grace=0)
        store.close()
