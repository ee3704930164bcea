"""Node ids are unique cluster-wide through etcd: a node on an etcd:// master claims its id
under a lease of its own before it serves; a second process with the same id waits until
the first stops (at once) or dies (within the claim's lease), and never serves meanwhile.

Real etcd, masters and nodes (skipped without an etcd binary, like tests/test_failover.py).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time

import pytest

from bench.etcd_process import EtcdProcess, etcd_binary
from bench.failover import run_cluster, wait_until
from kvstore.node.id_claim import DEFAULT_TTL_S, NodeIdClaim
from kvstore_client import Client
from kvstore_client.etcd import Etcd
from processes import ROOT

pytestmark = pytest.mark.skipif(
    etcd_binary() is None, reason="no etcd binary on PATH (apt-get install etcd-server; scripts/test does it as root)"
)


def test_one_claim_at_a_time_and_a_released_id_is_free_at_once(tmp_path):
    with EtcdProcess(tmp_path) as etcd_server:
        etcd = Etcd([etcd_server.endpoint])
        first = NodeIdClaim(etcd, "/kvstore", "node-x", "first holder")
        second = NodeIdClaim(etcd, "/kvstore", "node-x", "second holder")
        other = NodeIdClaim(etcd, "/kvstore", "node-y", "third holder")
        try:
            assert first.acquire(timeout=5)
            assert not second.acquire(timeout=1.0, poll_s=0.2)
            assert second.held_by == "first holder"
            assert other.acquire(timeout=5)  # another id: no conflict
            time.sleep(DEFAULT_TTL_S + 1)  # the first claim is kept alive past its TTL
            assert not second.acquire(timeout=0.5, poll_s=0.2)
            first.release()
            assert second.acquire(timeout=2)
            assert etcd.get(second.key).value == b"second holder"
        finally:
            for claim in (first, second, other):
                claim.release()
            etcd.close()


def start_node(address: str, data_dir, log) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    args = [
        "node",
        "--master",
        address,
        "--port",
        "0",
        "--metrics-port",
        "-1",
        "--data-dir",
        str(data_dir),
        "--dram",
        "32MiB",
        "--ssd",
        "0",
        "--json",
    ]
    return subprocess.Popen(
        [sys.executable, "-m", "kvstore.cli", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True
    )


def ready_line(proc: subprocess.Popen, timeout: float) -> dict | None:
    """The JSON line a node prints once it serves, or None if none came within ``timeout``."""
    readable, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if readable else ""
    return json.loads(line) if line else None


def test_a_second_process_with_the_id_waits_until_the_first_is_gone(tmp_path):
    with run_cluster(tmp_path, lease_ttl=2) as (_etcd, _masters, first, address):
        node_id = first.record["node_id"]
        twin_dir = tmp_path / "twin"
        twin_dir.mkdir(mode=0o700)
        shutil.copy(tmp_path / "node" / "node_id", twin_dir / "node_id")  # a copied data directory
        with open(tmp_path / "twin.log", "w") as log:
            twin = start_node(address, twin_dir, log)
        try:
            assert ready_line(twin, timeout=4) is None  # holds off while the first one runs
            assert "is held in etcd by another process" in (tmp_path / "twin.log").read_text()
            shutil.copytree(twin_dir, tmp_path / "third")
            with open(tmp_path / "third.log", "w") as log:
                third = start_node(address, tmp_path / "third", log)
            wait_until(lambda: "is held in etcd" in (tmp_path / "third.log").read_text(), 20)
            third.send_signal(signal.SIGTERM)  # a stop while waiting for the id ends the wait
            assert third.wait(10) == 1
            third.stdout.close()
            said = (tmp_path / "third.log").read_text()
            assert "stopped waiting" in said and "Traceback" not in said
            with Client(address) as client:
                (node,) = client.cluster_status().nodes
                assert node.info.node_id == node_id and node.info.data_address == first.record["data"]
                first.signal(signal.SIGKILL)  # dies without releasing: the claim lapses with its lease
                killed = time.monotonic()
                record = ready_line(twin, timeout=DEFAULT_TTL_S + 15)
                assert record is not None and record["node_id"] == node_id
                assert time.monotonic() - killed < DEFAULT_TTL_S + 15
                wait_until(
                    lambda: [n.info.data_address for n in client.cluster_status().nodes if n.alive] == [record["data"]],
                    20,
                )
            assert "Traceback" not in (tmp_path / "twin.log").read_text()
        finally:
            twin.send_signal(signal.SIGTERM)
            twin.wait(30)
            twin.stdout.close()
