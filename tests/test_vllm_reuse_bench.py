"""bench.vllm_reuse runs end to end on a tiny model: engines, pool, the load path, the report."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # a benchmark run (two minutes here): -m slow


def test_the_reuse_benchmark_runs_small(capsys, monkeypatch):
    from bench import vllm_reuse

    monkeypatch.setenv("KVSTORE_LMCACHE_PYTHON", "/nonexistent")  # LMCache's side is its own environment
    vllm_reuse.main(
        [
            "--hidden",
            "128",
            "--layers",
            "2",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--lengths",
            "96,160",
            "--block-size",
            "32",
            "--runs",
            "1",
            "--kv-cache-bytes",
            str(256 << 20),
            "--json",
        ]
    )
    result = json.loads(capsys.readouterr().out)
    rows = {r["prompt_tokens"]: r for r in result["ttft"]}
    assert rows[96]["consumer_cached_tokens"] == 95  # three full blocks: all load, vLLM computes one token
    assert rows[160]["consumer_cached_tokens"] == 159
    assert all(r["consumer_same_output"] for r in rows.values())
    assert all(r["recompute_s"] > 0 and r["consumer_hit_s"] > 0 and r["producer_miss_s"] > 0 for r in rows.values())
    assert result["load_path"]["rates"]["bytes"] == 2 * (160 // 32) * 2 * 32 * 64 * 4  # layers x blocks x slab
    assert any(note.startswith("LMCache: no LMCache environment") for note in result["skipped"])
    assert len(result["targets"]) == 5


def test_bad_arguments_are_a_usage_error(capsys):
    from bench import vllm_reuse

    with pytest.raises(SystemExit) as exit_info:
        vllm_reuse.main(["--lengths", "16", "--block-size", "32"])
    assert exit_info.value.code == 2 and "lengths must exceed the block size" in capsys.readouterr().err
