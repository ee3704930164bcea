"""bench.idle runs end to end against a real master and node (a short run: the figures are the
benchmark's, not this test's)."""

from __future__ import annotations

import json

from bench.idle import main


def test_the_idle_bench_measures_every_process(capsys):
    main(["--seconds", "1", "--settle", "1", "--runs", "1", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert set(result["median"]) == {"master", "node", "bare_grpc_server"}
    node = result["median"]["node"]
    assert node["wakeups_per_s"] > 0 and node["cpu_ms_per_s"] > 0  # it heartbeats, at least
