"""bench.fuzz, briefly: a real master and two nodes (one with an access file) fuzzed for a few
seconds from other processes. Nothing crashes, nothing logs a traceback, the well-behaved client
is served throughout, every op was sent, the master's conductor port was fuzzed and answered
every frame with a well-formed reply, and memory and fds stay bounded (generous bounds; no
timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def test_a_short_fuzz_run_breaks_nothing():
    proc = subprocess.run(
        [sys.executable, "-m", "bench.fuzz", "--frames", "200000", "--seconds", "10", "--seed", "7", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.stdout, proc.stderr[-4000:]
    r = json.loads(proc.stdout)
    assert r["frames_sent"] > 0 and r["replies"] > 0 and r["grpc_calls"] > 0
    assert r["crashes"] == 0 and r["node_crashes"] == 0, r["processes"]
    assert r["tracebacks"] == 0, r.get("traceback_excerpts")
    assert r["good_client_failures"] == 0, r["good_client_errors"]
    assert sum(r["good_client_ops"].values()) > 0
    assert r["stalled_connections"] == 0
    assert r["ops_missing"] == [], r["ops_missing"]
    assert r["grpc_methods_covered"].split("/")[0] == r["grpc_methods_covered"].split("/")[1]
    c = r["conductor_port"]
    assert c["frames"] > 0 and c["connections"] > 0 and c["replies"] > 0, c
    assert c["malformed_replies"] == 0, c["errors"]
    assert c["stalls"] == 0 and c["probe"] == "ok", c
    assert r["conductor_port_ok"]
    for name, p in r["processes"].items():
        assert p["rss_anon_growth"] < 256 * MiB, (name, p)
        assert p["end"]["fds"] <= p["start"]["fds"] + 32, (name, p)
    assert r["ok"] and proc.returncode == 0
