"""The benchmarks run, and the hit-rate replay counts what it should."""

from __future__ import annotations

import json

import pytest

from bench import engine, fragmentation, hit_rate

TRACE = [
    {"timestamp": 0, "hash_ids": [0, 1, 2]},
    {"timestamp": 1, "hash_ids": [0, 1, 3]},
    {"timestamp": 2, "hash_ids": [0, 1, 2]},
]


def test_hit_rate_unbounded_counts_leading_hits():
    result = hit_rate.replay(TRACE, "lru", None)
    assert (result["hit_blocks"], result["blocks"]) == (5, 9)  # 0 + 2 + 3


@pytest.mark.parametrize("policy, hits", [("lru", 4), ("lfu", 4), ("length_aware", 4)])
def test_hit_rate_bounded_evicts(policy, hits):
    # capacity 3: request 2 stores block 3 and must evict; block 2 (never read) goes under every policy,
    # so request 3 hits 0 and 1 only.
    result = hit_rate.replay(TRACE, policy, 3)
    assert result["hit_blocks"] == hits and result["evictions"] == 2


def test_hit_rate_cli_reads_a_trace_file(tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in reversed(TRACE)))  # replay sorts by timestamp
    hit_rate.main(["--trace", str(path), "--capacity", "inf", "--json"])
    assert json.loads(capsys.readouterr().out)["prefix_hit_ratio"] == pytest.approx(5 / 9)


def test_engine_bench_runs_small(capsys):
    engine.main(["--sizes", "64KiB", "--working-set", "1MiB", "--repeats", "1", "--json"])
    result = json.loads(capsys.readouterr().out)["64KiB"]
    assert result["put_gbps"] > 0 and result["get_gbps"] > 0 and result["memcpy_gbps"] > 0


def test_fragmentation_bench_equal_sizes_waste_nothing():
    result = fragmentation.churn(64 << 20, 2000, 1 << 20, 1 << 20, seed=1)
    assert result["mean_utilization"] == 1.0


def test_dataplane_bench_runs_small(capsys):
    from bench import dataplane

    dataplane.main(["--working-set", "8MiB", "--repeats", "1", "--batch-blocks", "64", "--json"])
    result = json.loads(capsys.readouterr().out)
    single = result["single"]
    for name in (
        "memcpy_gbps",
        "shm_memcpy_gbps",
        "shm_get_gbps",
        "tcp_get_gbps",
        "raw_socket_gbps",
        "shm_put_gbps",
        "shm_put_nowait_gbps",
        "arena_write_gbps",
        "arena_write_xxh3_gbps",
    ):
        assert single[name] > 0
    assert single["shm_get_vs_memcpy"] > 0 and single["shm_get_vs_shm_memcpy"] > 0
    assert result["tcp_batch_64k"]["blocks_per_s"] > 0 and len(result["targets"]) == 4


def test_tiering_bench_runs_small(capsys):
    from bench import tiering

    # 24 blocks of 64 KiB through 512 KiB of DRAM. How many reads promote (and so later demote)
    # depends on when the background evictor runs; the contract tests pin the behaviour down
    # (tests/test_store_contract.py, kept SSD copies).
    tiering.main(
        [
            "--blocks",
            "24",
            "--size",
            "64KiB",
            "--dram",
            "512KiB",
            "--ssd",
            "4MiB",
            "--rounds",
            "2",
            "--patterns",
            "cyclic,random",
            "--json",
        ]
    )
    results = json.loads(capsys.readouterr().out)["results"]
    assert set(results) == {"cyclic", "random"}
    for result in results.values():
        for mode in ("keep", "drop"):
            assert result[mode]["reads_per_s"] > 0
            assert 0 <= result[mode]["ssd_bytes_written_per_read"] <= 2 * 64 * 1024  # about a demotion per read at most
        assert result["keep_vs_drop_reads"] > 0


def test_gc_pauses_bench_runs_small(capsys):
    from bench import gc_pauses

    gc_pauses.main(["--blocks", "3000", "--puts", "1000", "--runs", "1", "--json"])
    modes = json.loads(capsys.readouterr().out)["modes"]
    assert set(modes) == {"default", "frozen"}
    for phases in modes.values():
        assert set(phases) == {"fill", "churn"}
        for figures in phases.values():
            assert figures["longest_put_ms"] >= figures["p999_put_ms"] > 0
            assert figures["total_collection_ms"] >= figures["longest_collection_ms"] >= 0


def test_cpu_per_op_bench_runs_small(capsys, tmp_path):
    from bench import cpu_per_op

    cpu_per_op.main(
        [
            "--clients",
            "2",
            "--size",
            "64KiB",
            "--count",
            "8",
            "--seconds",
            "0.2",
            "--repeats",
            "1",
            "--unix",
            str(tmp_path / "node.sock"),
            "--json",
        ]
    )
    result = json.loads(capsys.readouterr().out)
    for kind in ("kvstore", "raw"):
        assert result[kind]["gbps"] > 0 and result[kind]["clients_us"] > 0
        assert result[kind]["server_user_us"] + result[kind]["server_system_us"] > 0
    assert result["kvstore_vs_raw"] > 0 and len(result["runs"]["kvstore"]) == 1
