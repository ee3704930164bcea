"""bench.soak, briefly (--minutes 0.2): the report's shape (series per process, a verdict per
series, the ops), no wrong values, no errors, no crash, no traceback. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_short_soak_reports_every_process():
    proc = subprocess.run(
        [sys.executable, "-m", "bench.soak", "--minutes", "0.2", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout)
    assert set(r["processes"]) == {"master", "node-1", "node-2", "clients"}
    for name, p in r["processes"].items():
        assert len(p["samples"]) >= 2, name
        for sample in p["samples"]:
            assert {"t", "rss_anon", "rss_file", "rss_shmem", "fds", "threads"} <= set(sample), name
        assert "flat" in p["verdict"]
    assert r["verdict"] in ("flat after warm-up", "not flat") and r["how"]
    assert r["ops"].get("put", 0) > 0 and r["ops"].get("get", 0) > 0
    assert r["wrong_values"] == 0 and r["errors"] == 0, r["error_samples"]
    assert r["crashed"] == [] and not any(r["tracebacks"].values())
    assert r["working_set_mib"] > r["pool_dram_mib"]
