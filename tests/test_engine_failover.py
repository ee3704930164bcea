"""Engines survive a master failover: the load reporter registers again when a new master does
not know it (kvstore_client.vllm.engines.EngineAnnouncement driven directly, no vLLM).

With etcd: two master processes and a node process (bench.failover.run_cluster); the leader
is killed with SIGKILL, the standby takes over, and within a few report intervals Schedule at
the new leader picks the engine again. Without etcd: a master stopped and started again on
the same port. The etcd test is skipped when no ``etcd`` binary is on PATH.
"""

from __future__ import annotations

import signal
import time

import pytest

from bench.etcd_process import etcd_binary
from bench.failover import leader_of, run_cluster
from kvstore.master.server import MasterServer
from kvstore.node.config import StoreConfig
from kvstore.node.daemon import NodeOptions, StorageNode
from kvstore_client import Client
from kvstore_client.errors import KVStoreError, Overloaded
from kvstore_client.vllm.engines import EngineAnnouncement
from kvstore_client.vllm.settings import read_settings
from tests.processes import wait_for

NAMESPACE = "vllm/layer0"
INTERVAL = 0.2
MiB = 1 << 20


def announce(client: Client, master: str) -> EngineAnnouncement:
    settings = read_settings(
        {"master": master, "role": "both", "engine_url": "http://127.0.0.1:8001", "load_report_interval": INTERVAL},
        "kv_both",
    )
    engine = EngineAnnouncement(
        client, settings, NAMESPACE, block_size=16, hash_algo="sha256", hash_seed=None, model="tiny"
    )
    engine.start()
    return engine


def scheduled(client: Client):
    """The placement Schedule gives now, or None while no engine is known (or no master serves)."""
    try:
        return client.scheduling.schedule([(NAMESPACE, b"p" * 32)], 16, 4, namespace=NAMESPACE)
    except Overloaded as exc:
        assert exc.reason == "no_instance", exc
        return None
    except KVStoreError:
        return None


def check_picked(placement, engine: EngineAnnouncement) -> None:
    assert placement.prefill_engine == engine.ids["prefill"] and placement.decode_engine == engine.ids["decode"]
    assert placement.prefill_node == engine.node_id


@pytest.mark.skipif(etcd_binary() is None, reason="no etcd binary on PATH (apt-get install etcd-server)")
def test_an_engine_registers_again_with_the_new_leader_after_kill_9(tmp_path):
    with run_cluster(tmp_path, lease_ttl=2) as (etcd, (first, second), node, address):
        with Client(address, timeout=10) as client, Client(address, timeout=10) as scheduler:
            wait_for(lambda: client.cluster_status().nodes, 15)
            engine = announce(client, address)
            try:
                check_picked(wait_for(lambda: scheduled(scheduler), 10), engine)
                first.signal(signal.SIGKILL)
                wait_for(lambda: leader_of(etcd.endpoint) == second.record["master"], 15)
                took_over = time.monotonic()
                placement = wait_for(lambda: scheduled(scheduler), 10)
                print(f"engine known to the new leader {time.monotonic() - took_over:.2f} s after its takeover")
                check_picked(placement, engine)
                assert engine.reregistered == 2  # both conductor ids, once each
            finally:
                engine.close()
            assert scheduled(scheduler) is None  # closed: deregistered from the new leader


def test_an_engine_registers_again_with_a_restarted_master(tmp_path):
    master = MasterServer(ttl_s=5.0, heartbeat_interval_s=0.2).start()
    port = master.port
    node = StorageNode(
        StoreConfig(dram_capacity=8 * MiB, max_block_bytes=MiB),
        NodeOptions(master=master.address, unix_socket=False, data_dir=str(tmp_path / "node")),
    ).start()
    try:
        with Client(master.address, timeout=5) as client, Client(master.address, timeout=5) as scheduler:
            wait_for(lambda: client.cluster_status().nodes, 10)
            engine = announce(client, master.address)
            try:
                check_picked(wait_for(lambda: scheduled(scheduler), 10), engine)
                master.stop(grace=0)
                master = MasterServer(port=port, ttl_s=5.0, heartbeat_interval_s=0.2).start()
                restarted = time.monotonic()
                check_picked(wait_for(lambda: scheduled(scheduler), 10), engine)
                assert time.monotonic() - restarted < 20 * INTERVAL
                assert engine.reregistered == 2
            finally:
                engine.close()
    finally:
        node.stop()
        master.stop(grace=0)
