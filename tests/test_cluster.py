"""A real pool: master and storage nodes as separate processes on 127.0.0.1."""

from __future__ import annotations

import urllib.request

import numpy as np
import pytest

import signal

from kvstore_client import BlockHasher, Client, PutFailed
from tests.conftest import run_in_threads, value_for
from tests.processes import start_master, start_node, wait_for

KiB = 1 << 10


def keys_of(n: int, ns: str = "m"):
    return BlockHasher(ns, 4).keys(list(range(4 * n)))


def stopped(pid: int) -> bool:
    """Whether the process is stopped (state T in /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def node_ids(client: Client, alive_only: bool = True) -> set[str]:
    return {n.info.node_id for n in client.cluster_status().nodes if n.alive or not alive_only}


@pytest.fixture
def cluster(tmp_path):
    """A master and three nodes; yields (master, nodes) and stops them all."""
    services = []
    master = start_master(ttl=1.0)
    services.append(master)
    nodes = [start_node(master.record["master"], tmp_path / f"n{i}") for i in range(3)]
    services.extend(nodes)
    with Client(master.record["master"]) as probe:
        wait_for(lambda: len(node_ids(probe)) == 3)
    yield master, nodes
    for service in services:
        service.close()


def test_put_on_one_client_get_from_another(cluster):
    master, _ = cluster
    keys = keys_of(20)
    values = [value_for(k, 300 * KiB + i) for i, k in enumerate(keys)]
    with Client(master.record["master"]) as writer:
        writer.batch_put(keys, values, depths=range(len(keys)))
    with Client(master.record["master"], prefer_shm=False) as tcp_reader, Client(master.record["master"]) as shm_reader:
        wait_for(lambda: all(tcp_reader.batch_exists(keys)))
        assert tcp_reader.batch_get(keys) == values
        out = [np.empty(400 * KiB, dtype=np.uint8) for _ in keys]
        sizes = shm_reader.batch_get_into(keys, out)
        assert [bytes(o[:n]) for o, n in zip(out, sizes)] == values


def test_prefix_match_across_nodes(cluster):
    from kvstore_client.connect import open_connection

    master, nodes = cluster
    keys = keys_of(8)
    with Client(master.record["master"]) as client:
        infos = {n.info.node_id: n.info for n in client.cluster_status().nodes}
        first, second = (infos[n.record["node_id"]] for n in nodes[:2])
        conn_a, conn_b = open_connection(first, prefer_shm=False), open_connection(second, prefer_shm=False)
        try:
            conn_a.put_many([(k, value_for(k, 1000), d) for d, k in enumerate(keys[:5])])
            conn_b.put_many([(k, value_for(k, 1000), d) for d, k in enumerate(keys[:2])])
            conn_b.put_many([(keys[5], value_for(keys[5], 1000), 5)])
        finally:
            conn_a.close()
            conn_b.close()
        match = wait_for(lambda: (m := client.match_prefix(keys)).longest == 6 and m)
        assert match.per_node[first.node_id] == 5
        assert match.per_node[second.node_id] == 2


def test_a_burst_of_puts_spreads_over_the_nodes(cluster):
    """Heartbeats are a second apart; placements charged to their node spread a burst anyway."""
    master, nodes = cluster
    keys = keys_of(24, ns="burst")
    with Client(master.record["master"], placement_bytes=512 * KiB) as client:
        for i in range(0, len(keys), 2):
            client.batch_put(keys[i : i + 2], [value_for(k, 256 * KiB) for k in keys[i : i + 2]])

        def holders() -> set[str]:
            return {node_id for replicas in client._locate(keys, use_cache=False) for node_id, _ in replicas}

        wait_for(lambda: len(holders()) == 3)
        assert holders() == {n.record["node_id"] for n in nodes}


def test_killed_node_reads_as_miss_then_leaves_the_index(cluster):
    master, nodes = cluster
    keys = keys_of(10)
    values = [value_for(k, 64 * KiB) for k in keys]
    with Client(master.record["master"], prefer_shm=False, location_ttl=0) as client:  # the index's view only
        client.batch_put(keys, values)
        located = wait_for(lambda: all(client.batch_exists(keys)))
        holder = next(n for n in nodes if client._locate([keys[0]], use_cache=False)[0][0][0] == n.record["node_id"])
        holder.kill()
        got = client.batch_get(keys)  # the node is gone: misses, never errors, never wrong bytes
        assert all(g is None or g == v for g, v in zip(got, values))
        wait_for(lambda: holder.record["node_id"] not in node_ids(client), timeout=10)
        wait_for(lambda: not any(client.batch_exists(keys)), timeout=10)
        assert located


def test_puts_not_waited_for_to_a_node_that_dies_raise_put_failed(tmp_path):
    """The node is frozen (SIGSTOP) before the puts reach it, then killed: wait_for_puts names
    every block and the node; the blocks read as misses, never as errors."""
    master = start_master(ttl=1.0)
    node = start_node(master.record["master"], tmp_path / "n", ssd="0")
    try:
        with Client(master.record["master"], data_path="tcp", placement_ttl=60) as client:
            wait_for(lambda: node_ids(client))
            warm, *keys = keys_of(6, ns="frozen")
            client.put(warm, value_for(warm, 16 * KiB))  # placement and connection made
            node.proc.send_signal(signal.SIGSTOP)
            wait_for(lambda: stopped(node.proc.pid))  # a signal is delivered, not always at once
            for k in keys:
                client.put(k, value_for(k, 16 * KiB), wait=False)
            node.kill()
            with pytest.raises(PutFailed) as failed:
                client.wait_for_puts()
            assert [k for k, _, _ in failed.value.failures] == keys
            assert {n for _, n, _ in failed.value.failures} == {node.record["node_id"]}
            assert client.batch_get(keys) == [None] * len(keys)
            client.wait_for_puts()  # reported once
    finally:
        node.close()
        master.close()


def test_node_restart_brings_ssd_blocks_back(tmp_path):
    master = start_master(ttl=1.0)
    node = start_node(master.record["master"], tmp_path / "n", dram="2MiB", ssd="64MiB", max_block="1MiB")
    try:
        keys = keys_of(40)
        values = [value_for(k, 200 * KiB) for k in keys]
        with Client(master.record["master"], prefer_shm=False, location_ttl=0) as client:
            wait_for(lambda: node_ids(client))
            for k, v in zip(keys, values):
                client.put(k, v)
            wait_for(lambda: all(client.batch_exists(keys)))
            ssd_before = wait_for(
                lambda: sum(t.blocks for n in client.cluster_status().nodes for t in n.tiers if t.tier == "ssd")
            )
            node.kill()
            wait_for(lambda: not any(client.batch_exists(keys)), timeout=10)
            node = start_node(master.record["master"], tmp_path / "n", dram="2MiB", ssd="64MiB", max_block="1MiB")
            back = wait_for(lambda: sum(client.batch_exists(keys)) >= ssd_before and sum(client.batch_exists(keys)))
            assert back >= ssd_before
            got = client.batch_get(keys)
            assert sum(g is not None for g in got) >= ssd_before
            assert all(g is None or g == v for g, v in zip(got, values))
    finally:
        node.close()
        master.close()


@pytest.mark.parametrize("data_path", ["shm", "tcp"])
def test_a_client_follows_a_restarted_node_to_its_new_port_and_arena(tmp_path, data_path):
    master = start_master(ttl=1.0)
    node = start_node(master.record["master"], tmp_path / "n", dram="8MiB", ssd="0")
    try:
        # placements kept a minute: the client still holds the old addresses when it next writes
        with Client(master.record["master"], data_path=data_path, placement_ttl=60) as client:
            wait_for(lambda: node_ids(client))
            before, after = keys_of(4, ns="restart"), keys_of(8, ns="restart")[4:]
            client.batch_put(before, [value_for(k, 64 * KiB) for k in before])
            assert client.get(before[0]) == value_for(before[0], 64 * KiB)
            old_address = node.record["data"]
            node.kill()
            node = start_node(master.record["master"], tmp_path / "n", dram="8MiB", ssd="0")
            assert node.record["data"] != old_address
            wait_for(
                lambda: any(
                    n.alive and n.info.data_address == node.record["data"] for n in client.cluster_status().nodes
                )
            )
            client.batch_put(after, [value_for(k, 64 * KiB) for k in after])  # redials at the new address
            assert client.batch_get(after) == [value_for(k, 64 * KiB) for k in after]
            assert client.get(before[0]) is None  # DRAM did not survive the kill: a miss, not an error
    finally:
        node.close()
        master.close()


def test_master_restart_rebuilds_the_index(tmp_path):
    master = start_master(ttl=1.0)
    address = master.record["master"]
    port = int(address.rsplit(":", 1)[1])
    nodes = [start_node(address, tmp_path / f"n{i}") for i in range(2)]
    try:
        keys = keys_of(30)
        values = [value_for(k, 10 * KiB) for k in keys]
        with Client(address, prefer_shm=False, location_ttl=0) as client:
            wait_for(lambda: len(node_ids(client)) == 2)
            client.batch_put(keys, values)
            wait_for(lambda: all(client.batch_exists(keys)))
        master.kill()
        master = start_master(port=port, ttl=1.0)
        with Client(address, prefer_shm=False, location_ttl=0) as client:
            wait_for(lambda: all(client.batch_exists(keys)), timeout=15)
            assert client.batch_get(keys) == values
    finally:
        for service in [*nodes, master]:
            service.close()


def test_many_concurrent_clients(cluster):
    master, _ = cluster

    def worker(w: int) -> None:
        with Client(master.record["master"], prefer_shm=w % 2 == 0) as client:
            keys = keys_of(20, ns=f"tenant{w}")
            values = [value_for(k, 20 * KiB + w) for k in keys]
            for _ in range(3):
                client.batch_put(keys, values)
                got = client.batch_get(keys)
                assert all(g is None or g == v for g, v in zip(got, values))
                assert sum(g is not None for g in got) == len(keys)

    errors = run_in_threads(worker, 8, timeout=60)
    assert not errors, errors


def test_metrics_endpoints(cluster):
    master, nodes = cluster
    with Client(master.record["master"], prefer_shm=False) as client:
        client.put(keys_of(1, "metrics")[0], b"m" * 5000)
    for url, name in (
        (master.record["metrics"], "kvstore_"),
        (nodes[0].record["metrics"], "kvstore_tier_used_bytes"),
        (nodes[0].record["metrics"], "kvstore_ssd_written_bytes_total"),
        (nodes[0].record["metrics"], "kvstore_ssd_disk_full_total"),
        (nodes[0].record["metrics"], "kvstore_node_granted_bytes"),
    ):
        body = urllib.request.urlopen(f"http://{url}/metrics", timeout=5).read().decode()
        assert name in body and "# TYPE" in body
    published = 0
    for node in nodes:
        body = urllib.request.urlopen(f"http://{node.record['metrics']}/metrics", timeout=5).read().decode()
        published += int(
            float(
                next(line.split()[-1] for line in body.splitlines() if line.startswith("kvstore_node_directory_blocks"))
            )
        )
    assert published == 1  # the block is readable without a round trip on the node that holds it


def test_replicated_blocks_survive_a_node_loss(tmp_path):
    master = start_master(ttl=1.0, replicas=2)
    nodes = [start_node(master.record["master"], tmp_path / f"n{i}") for i in range(3)]
    try:
        keys = keys_of(12)
        values = [value_for(k, 50 * KiB) for k in keys]
        with Client(master.record["master"], prefer_shm=False, location_ttl=0) as client:
            wait_for(lambda: len(node_ids(client)) == 3)
            client.batch_put(keys, values)
            holders = wait_for(
                lambda: (loc := client._locate(keys, use_cache=False)) and all(len(r) == 2 for r in loc) and loc
            )
            victim = holders[0][0][0]
            next(n for n in nodes if n.record["node_id"] == victim).kill()
            assert client.batch_get(keys) == values  # served by the surviving replicas
    finally:
        for service in [*nodes, master]:
            service.close()
