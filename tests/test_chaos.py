"""bench.chaos for ~45 s: a real master (replicas 2) and three nodes under verifying clients on
every data path, while nodes and the master are killed -9 and restarted, SSD records are
corrupted and half PUT frames are sent. Nothing may read back wrong, raise untyped or hang,
and every block acknowledged with both copies survives one node's death."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.processes import ROOT


def test_chaos_run_reads_nothing_wrong():
    args = [
        sys.executable,
        "-m",
        "bench.chaos",
        "--seconds",
        "45",
        "--clients",
        "6",
        "--node-kills-per-minute",
        "3",
        "--master-kills-per-minute",
        "1",
        "--corruptions",
        "2",
        "--seed",
        "7",
        "--json",
    ]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout)
    detail = json.dumps(
        {
            k: r.get(k)
            for k in (
                "wrong_byte_samples",
                "untyped_samples",
                "hang_samples",
                "chaos_step_errors",
                "replica_survival",
                "events",
            )
        },
        indent=1,
    )
    assert r["wrong_bytes"] == 0, detail
    assert r["untyped_exceptions"] == 0, detail
    assert r["hangs"] == 0, detail
    assert r["chaos_step_errors"] == [], detail
    assert r["node_kills"] >= 1 and r["master_kills"] >= 1, detail
    assert r["verified_reads"] > 0 and set(r["ops"]) >= {
        "put",
        "batch_put",
        "get",
        "get_into",
        "batch_get",
        "exists",
        "remove",
        "match_prefix",
    }
    survival = r["replica_survival"]
    assert survival["both_copies_acknowledged"] == survival["written"] > 0, detail
    assert survival["fraction"] == 1.0, detail
    assert r["corruptions"]["live_records_damaged"] > 0 and r["corruptions"]["offline_records_damaged"] > 0, detail
    assert "WRONG" not in r["corruptions"]["read_back"], detail
    assert r["truncated_frames"] > 0
    assert all(s is not None for s in r["index_rebuild_s"]), detail  # the index came back whole
