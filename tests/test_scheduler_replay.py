"""bench.replay: the real Conductor, PrefixIndex and eviction policies under a simulated clock."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from bench import replay


def synthetic_trace(requests: int = 300, sessions: int = 30, gap_ms: int = 400, seed: int = 1) -> list[dict]:
    """Multi-turn sessions: each turn extends its session's chain, all share a 2-block system prompt."""
    rng = random.Random(seed)
    next_id = 100
    chains = {}
    out = []
    for i in range(requests):
        s = rng.randrange(sessions)
        chain = chains.get(s, [0, 1])
        new = list(range(next_id, next_id + rng.randint(1, 6)))
        next_id += len(new)
        chains[s] = chain = chain + new
        out.append(
            {
                "timestamp": i * gap_ms,
                "input_length": len(chain) * 512 - rng.randrange(512),
                "output_length": rng.randint(20, 400),
                "hash_ids": list(chain),
            }
        )
    return out


TRACE = synthetic_trace()


@pytest.mark.parametrize("policy", ["random", "load_balance", "cache_aware", "kvcache_centric"])
def test_every_policy_replays_and_serves_everything_without_admission(policy):
    r = replay.replay(TRACE, policy, prefill=4, decode=2, cache_blocks=200)
    assert r["served"] == r["requests"] == len(TRACE) and r["rejected"] == 0
    assert 0 < r["p50_ttft_s"] <= r["p90_ttft_s"] <= r["p99_ttft_s"]
    assert r["mean_ttft_s"] > 0 and 0 <= r["ttft_slo_attainment"] <= 1
    assert 0 < r["prefix_hit_ratio"] < 1
    assert (r["blocks_transferred"] > 0) == (policy == "kvcache_centric")
    assert r["prefix_hit_ratio"] >= r["local_hit_ratio"]


def test_cache_awareness_raises_hits_and_lowers_ttft():
    # Caches hold the working set once over (about 1,000 distinct blocks, 4 x 400 slots). Much smaller
    # ones (4 x 200) thrash under kvcache_centric: replicas of fetched prefixes evict other sessions.
    runs = {
        p: replay.replay(TRACE, p, prefill=4, decode=2, cache_blocks=400, speed=3)
        for p in ("random", "cache_aware", "kvcache_centric")
    }
    assert runs["kvcache_centric"]["prefix_hit_ratio"] >= runs["cache_aware"]["prefix_hit_ratio"]
    assert runs["cache_aware"]["prefix_hit_ratio"] > runs["random"]["prefix_hit_ratio"]
    assert runs["kvcache_centric"]["mean_ttft_s"] < runs["cache_aware"]["mean_ttft_s"] < runs["random"]["mean_ttft_s"]


def test_small_caches_evict_through_the_real_policy_and_index():
    r = replay.replay(TRACE, "kvcache_centric", prefill=2, decode=1, cache_blocks=20)
    big = replay.replay(TRACE, "kvcache_centric", prefill=2, decode=1, cache_blocks=10_000)
    assert r["evictions"] > 0 and big["evictions"] == 0
    assert r["prefix_hit_ratio"] < big["prefix_hit_ratio"]


OVERLOAD = dict(prefill=2, decode=1, speed=4, decode_kv_tokens=60_000, tbt_slo=0.1, ttft_slo=60, sample_s=2)


def test_overload_rejections_and_wasted_prefill():
    runs = {
        a: replay.replay(TRACE, "kvcache_centric", admission=a, **OVERLOAD) for a in ("none", "early", "prediction")
    }
    none = runs["none"]
    assert none["rejected_after_prefill"] > 0 and none["wasted_prefill_s"] > 0
    for a in ("early", "prediction"):
        assert runs[a]["rejected"] > 0 and runs[a]["rejected_after_prefill"] == 0 and runs[a]["wasted_prefill_s"] == 0
    for r in runs.values():
        assert r["served"] + r["rejected"] == len(TRACE)
        assert r["decode_load_series"] and r["decode_load_std"] >= 0 and r["decode_load_mean_abs_change"] >= 0


def test_arrival_jitter_is_seeded_and_keeps_every_request():
    plain = replay.to_sim_requests(TRACE, 2.0)
    assert [r.arrival for r in replay.to_sim_requests(TRACE, 2.0, jitter_s=0.0, seed=5)] == [r.arrival for r in plain]
    a, b, c = (replay.to_sim_requests(TRACE, 2.0, jitter_s=1.0, seed=s) for s in (0, 0, 1))
    assert [r.arrival for r in a] == [r.arrival for r in b] != [r.arrival for r in c]
    assert sorted(r.rid for r in a) == list(range(len(TRACE)))
    assert all(x.arrival <= y.arrival for x, y in itertools.pairwise(a))
    shift = {r.rid: r.arrival for r in a}
    assert all(0 <= shift[r.rid] - r.arrival < 1.0 for r in plain)


def test_admission_table_once_per_seed(capsys, tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in TRACE))
    opts = {k: str(v) for k, v in OVERLOAD.items()}
    replay.main(
        [
            "--trace",
            str(path),
            "--table",
            "admission",
            "--seeds",
            "0,1",
            "--jitter-s",
            "0.5",
            "--prefill",
            opts["prefill"],
            "--decode",
            opts["decode"],
            "--speed",
            opts["speed"],
            "--decode-kv-tokens",
            opts["decode_kv_tokens"],
            "--ttft-slo",
            opts["ttft_slo"],
            "--json",
        ]
    )
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert set(runs) == {f"{a} seed={s}" for a in ("none", "early", "prediction") for s in (0, 1)}
    for r in runs.values():
        assert r["served"] + r["rejected"] == len(TRACE) and r["served_decode_gtoken_steps"] > 0
        assert sum(int(n) for n in r["served_by_input"].split("/")) == r["served"]


def test_cli_json_and_tables(tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in reversed(TRACE)))  # replay sorts by timestamp
    replay.main(
        [
            "--trace",
            str(path),
            "--policy",
            "cache_aware",
            "--prefill",
            "2",
            "--decode",
            "1",
            "--cache-blocks",
            "100",
            "--speed",
            "2",
            "--admission",
            "none",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    for key in (
        "mean_ttft_s",
        "p50_ttft_s",
        "p90_ttft_s",
        "p99_ttft_s",
        "ttft_slo_attainment",
        "prefix_hit_ratio",
        "blocks_transferred",
        "rejected",
        "wasted_prefill_s",
        "decode_load_std",
    ):
        assert key in out
    assert out["requests"] == len(TRACE) and "decode_load_series" not in out
    replay.main(["--trace", str(path), "--table", "policies", "--prefill", "2", "--decode", "1", "--limit", "50"])
    table = capsys.readouterr().out
    assert "kvcache_centric" in table and "random" in table


def test_decision_latency_bench_runs_small():
    r = replay.decision_latency(blocks=4000, chain_len=40, prefill=4, decode=2, calls=300, in_flight=50)
    assert r["indexed_blocks"] == 4000
    assert set(r["policies"]) == {"random", "load_balance", "cache_aware", "kvcache_centric"}
    assert all(0 < v["p50_us"] <= v["p99_us"] <= v["max_us"] for v in r["policies"].values())


def test_a_replayed_request_does_not_evict_its_own_blocks():
    """LFU would pick the request's fresh blocks (no hits) over old, read ones; the request
    keeps them, as the real store does (BlockStore.request)."""
    from kvstore.master.index import PrefixIndex
    from bench.simulation import SimNode

    for policy in ("lru", "lfu", "length_aware"):
        node = SimNode("n", capacity=4, eviction=policy, index=PrefixIndex(), namespace="ns")
        node.store([b"o0", b"o1", b"o2", b"o3"])
        node.read([b"o0", b"o1", b"o2", b"o3"])
        node.store([b"o0", b"n1", b"n2"])  # a request: its prefix o0 read, then two fresh blocks
        assert all(d in node.keys for d in (b"o0", b"n1", b"n2")), policy
        assert len(node.keys) == 4 and node.evictions == 2
        node.store([b"x%d" % i for i in range(6)])  # longer than the cache: keeps what fits
        assert len(node.keys) == 4
