"""bench.security_overhead runs: all four configurations (plain, tokens, TLS, both) read the
node's blocks and open connections, with finite positive figures. Not a timing test."""

from __future__ import annotations

import json
import math

from bench import security_overhead

CONFIGS = ("plain", "auth", "tls", "tls_auth")


def test_security_overhead_bench_runs_small(capsys):
    security_overhead.main(
        ["--size", "64KiB", "--blocks", "4", "--rounds", "2", "--seconds", "0.02", "--connects", "2", "--json"]
    )
    result = json.loads(capsys.readouterr().out)
    figures = result["figures"]
    names = [f"{c}_gbps" for c in CONFIGS] + [f"{c}_connect_ms" for c in CONFIGS]
    names += [f"{c}_vs_plain" for c in CONFIGS[1:]] + [f"{c}_connect_vs_plain" for c in CONFIGS[1:]]
    for name in names:
        assert isinstance(figures[name], (int, float)) and math.isfinite(figures[name]) and figures[name] > 0, name
    assert figures["tls_cipher"].startswith("TLS")
    assert len(result["targets"]) == 2 and all(isinstance(v, bool) for v in result["targets"].values())
