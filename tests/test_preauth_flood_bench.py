"""bench.preauth_flood end to end at a small size: real processes, a flood that never
authenticates, and authenticated clients measured before and under it (figures are the
benchmark's business; this checks it runs and reports what it says it does)."""

from __future__ import annotations

import pytest

from bench.preauth_flood import run

pytestmark = pytest.mark.slow  # thousands of sockets and three processes: with the benchmarks, not in every run


def test_the_flood_benchmark_measures_every_operation_idle_and_flooded(tmp_path):
    result = run(connections=100, trickle=1.0, reopen_rate=200.0, calls=50, workdir=tmp_path)
    for phase in ("idle", "flood"):
        for op in ("get", "connect", "schedule"):
            assert result[phase][op]["failures"] == 0, (phase, op, result)
            assert 0 < result[phase][op]["p50_ms"] <= result[phase][op]["p99_ms"]
    assert result["served"] and result["node_alive"] and result["master_alive"]
    assert result["tracebacks"] == 0
    assert {"get_p99_vs_idle", "connect_p99_vs_idle", "schedule_p99_vs_idle"} <= set(result)
