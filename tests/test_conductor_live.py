"""The conductor inside a running master, with real storage nodes: decisions, real replication, 429s."""

from __future__ import annotations

import pytest

from kvstore_client import BlockHasher, Client, Overloaded
from kvstore_client.connect import open_connection
from tests.processes import start_master, start_node, wait_for

BLOCK_TOKENS = 512


@pytest.fixture
def pool(tmp_path):
    master = start_master(extra=("--schedule-policy", "kvcache_centric", "--admission", "early", "--ttft-slo", "30"))
    nodes = [start_node(master.record["master"], tmp_path / f"n{i}") for i in range(2)]
    client = Client(master.record["master"], location_ttl=0)
    wait_for(lambda: len([n for n in client.cluster_status().nodes if n.alive]) == 2)
    yield client, [n.record["node_id"] for n in nodes]
    client.close()
    for service in [*nodes, master]:
        service.close()


def test_busy_holder_means_fetch_and_real_replication(pool):
    client, (node_a, node_b) = pool
    ns = "llama3-70b"
    keys = BlockHasher(ns, BLOCK_TOKENS).keys(list(range(8 * BLOCK_TOKENS)))
    infos = {n.info.node_id: n.info for n in client.cluster_status().nodes}
    with open_connection(infos[node_a], prefer_shm=False) as conn:  # the prefix lives on node A only
        assert conn.put_many([(k, b"kv" * 500, depth) for depth, k in enumerate(keys)]) == [None] * len(keys)
    wait_for(lambda: client.match_prefix(keys).per_node.get(node_a) == 8)

    calls = client.scheduling
    calls.register_engine(ns, "prefill-a", "prefill", node_a)
    calls.register_engine(ns, "prefill-b", "prefill", node_b)
    calls.register_engine(ns, "decode-a", "decode", node_a)
    calls.report_load(ns, "prefill-a", queue_length=20, busy_s=25.0)  # the holder of the prefix is swamped

    placement = client.schedule(keys, input_length=len(keys) * BLOCK_TOKENS + 100, output_length=200)
    assert placement.prefill_engine == "prefill-b" and placement.decode_engine == "decode-a"
    assert placement.fetch_from_node == node_a and placement.fetch_blocks == 8
    assert placement.prefix_blocks == 8 and placement.prefix_tokens == 8 * BLOCK_TOKENS
    # the fetch became a real copy: node B now holds the whole prefix too
    wait_for(lambda: client.match_prefix(keys).per_node.get(node_b) == 8)

    reply = calls.report_request(ns, placement.request_id, "prefill_started")
    reply = calls.report_request(ns, placement.request_id, "prefill_finished")
    assert reply.decode_engine == "decode-a" and not reply.rejected
    calls.report_request(ns, placement.request_id, "decode_finished")


def test_cheap_to_recompute_stays_local_and_overload_is_429(pool):
    client, (node_a, node_b) = pool
    ns = "small-model"
    keys = BlockHasher(ns, BLOCK_TOKENS).keys(list(range(2 * BLOCK_TOKENS)))
    calls = client.scheduling
    calls.register_engine(ns, "p-a", "prefill", node_a)
    calls.register_engine(ns, "p-b", "prefill", node_b)
    calls.register_engine(ns, "d-a", "decode", node_a)
    placement = client.schedule(keys, input_length=2 * BLOCK_TOKENS)
    assert placement.fetch_from_node == "" and placement.fetch_blocks == 0  # nothing cached anywhere
    calls.report_load(ns, "p-a", queue_length=50, busy_s=100.0)
    calls.report_load(ns, "p-b", queue_length=50, busy_s=100.0)
    with pytest.raises(Overloaded) as rejected:  # every prefill queue is past the 30 s TTFT SLO
        client.schedule(keys, input_length=2 * BLOCK_TOKENS)
    assert rejected.value.reason == "ttft_slo"
