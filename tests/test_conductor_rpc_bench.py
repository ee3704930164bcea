"""bench.conductor_rpc runs end to end against a real master (a few calls: the figures are the
benchmark's, not this test's)."""

from __future__ import annotations

from bench.conductor_rpc import run, table


def test_the_conductor_rpc_bench_times_every_way_and_pacing(tmp_path):
    result = run(calls=5, runs=1, gap_ms=1.0, workdir=str(tmp_path))
    assert list(result["pacing"]) == ["back to back", "1 ms apart"]
    for paced in result["pacing"].values():
        assert set(paced["median_us"]) == {"socket", "grpc", "port"}
        assert all(us > 0 for us in paced["median_us"].values())
    assert "conductor port" in table(result)
