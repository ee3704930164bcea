"""The reusable Prometheus exporter (kvstore.metrics) and the master's run_master entry point."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import pytest

from kvstore.metrics import MetricsServer, render
from kvstore_client.proto import kvstore_pb2 as pb
from kvstore_client.proto import kvstore_pb2_grpc as pb_grpc


def test_render_groups_by_name_and_escapes():
    text = render(
        [
            ("x_total", "Things\ncounted.", "counter", {"k": 'a"b\\c\nd'}, 3),
            ("y", "A gauge.", "gauge", {}, 1.5),
            ("x_total", "ignored", "counter", {"k": "e"}, 4),
            ("z", "Odd type.", "weird", {}, float("inf")),
        ]
    )
    assert text == (
        "# HELP x_total Things\\ncounted.\n# TYPE x_total counter\n"
        'x_total{k="a\\"b\\\\c\\nd"} 3\nx_total{k="e"} 4\n'
        "# HELP y A gauge.\n# TYPE y gauge\ny 1.5\n"
        "# HELP z Odd type.\n# TYPE z untyped\nz +Inf\n"
    )


def test_metrics_server_serves_and_reports_collector_failures():
    calls = []

    def collect():
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("boom")
        return [("up", "Up.", "gauge", {}, 1)]

    with MetricsServer(0, collect) as server:
        url = f"http://{server.address}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            assert resp.status == 200 and resp.read() == b"# HELP up Up.\n# TYPE up gauge\nup 1\n"
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url, timeout=5)
        assert err.value.code == 500
    server.stop()  # idempotent


def test_run_master_serves_until_sigterm():
    code = (
        "import logging; from kvstore.master.server import run_master; "
        "run_master('127.0.0.1', 0, on_ready=lambda s: print(s.address, flush=True))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    try:
        address = proc.stdout.readline().strip()
        with grpc.insecure_channel(address) as channel:
            reply = pb_grpc.MasterStub(channel).Register(pb.RegisterRequest(info=pb.NodeInfo(node_id="n")), timeout=5)
            assert reply.ttl_s > reply.heartbeat_interval_s > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
