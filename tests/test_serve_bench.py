"""bench.serve: the trace slice and its token ids (fast), and one small run end to end with real vLLM
engines (slow: four engine starts, several minutes on two cores: -m slow). No timing is checked."""

from __future__ import annotations

import json

import pytest

from bench.serve_trace import build_requests, conversation_slice, prompt_of, reuse_bound

# two conversations of two turns each (the second turn extends the first's blocks), one of one turn
TRACE = [
    {"timestamp": 0, "input_length": 1400, "output_length": 30, "hash_ids": [0, 1, 2]},
    {"timestamp": 500, "input_length": 900, "output_length": 5, "hash_ids": [0, 7]},
    {"timestamp": 1000, "input_length": 1000, "output_length": 8, "hash_ids": [0, 10]},
    {"timestamp": 2000, "input_length": 2300, "output_length": 4, "hash_ids": [0, 1, 2, 3, 4]},
    {"timestamp": 3000, "input_length": 1600, "output_length": 50, "hash_ids": [0, 10, 11, 12]},
]


@pytest.fixture
def trace_file(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in TRACE))
    return str(path)


def test_the_slice_is_whole_conversations_of_two_or_more_turns():
    picked = conversation_slice(TRACE, 0, 10)
    assert [r["index"] for r in picked] == [0, 2, 3, 4]  # [0, 7] is a conversation of one turn
    assert [r["index"] for r in conversation_slice(TRACE, 1, 10)] == [2, 4]
    assert [r["index"] for r in conversation_slice(TRACE, 0, 3)] == [0, 2, 3]


def test_equal_hash_ids_give_equal_token_blocks(trace_file):
    requests = build_requests(
        trace_file, start=0, requests=4, block_tokens=32, vocab=1000, max_output=16, time_scale=0.5, rate=None
    )
    first, _, second, _ = requests
    assert len(first.prompt) == round(1400 * 32 / 512) == 88 and len(second.prompt) == 144
    assert second.prompt[:64] == first.prompt[:64]  # hash ids 0, 1
    assert second.prompt[64:88] == first.prompt[64:88]  # id 2: the first's partial last block
    assert requests[1].prompt[:32] == first.prompt[:32] and requests[1].prompt[32:62] != first.prompt[32:62]
    assert [r.max_tokens for r in requests] == [16, 8, 4, 16]
    assert [r.arrival_s for r in requests] == [0.0, 0.5, 1.0, 1.5]
    assert reuse_bound(requests) == pytest.approx((0 + 1 + 3 + 2) / (3 + 2 + 5 + 4))
    at_rate = build_requests(
        trace_file, start=0, requests=4, block_tokens=32, vocab=1000, max_output=16, time_scale=1, rate=4
    )
    assert [r.arrival_s for r in at_rate] == [0.0, 0.25, 0.5, 0.75]


def test_a_prompt_has_at_least_one_token_of_its_last_block():
    assert len(prompt_of({"hash_ids": [5, 6], "input_length": 520}, 32, 1000)) == 33


@pytest.mark.vllm
@pytest.mark.slow
def test_the_serving_benchmark_runs_small(trace_file, capsys):
    pytest.importorskip("vllm")
    from bench import serve

    serve.main(
        [
            "--trace",
            trace_file,
            "--requests",
            "4",
            "--block-tokens",
            "32",
            "--time-scale",
            "0.5",
            "--overhead-rounds",
            "1",
            "--overhead-pairs",
            "2",
            "--probe-tokens",
            "64",
            "--json",
        ]
    )
    result = json.loads(capsys.readouterr().out)
    prompt_tokens = result["config"]["slice"]["prompt_tokens"]
    assert prompt_tokens == 88 + 62 + 144 + 100
    for name, setup in result["setups"].items():
        assert setup["requests"] == 4 and setup["completed"] + setup["failed"] == 4, (name, setup["errors"])
        assert setup["completed"] == 4 and setup["meet_both_slos"] <= 4
        assert setup["output_tokens"] == 16 + 8 + 4 + 16
        for counts in setup["engines"].values():  # every prompt token is computed, cached or loaded
            assert (
                counts["local_compute"] + counts["local_cache_hit"] + counts["external_kv_transfer"] == counts["prompt"]
            )
        assert setup["prefill_tokens_computed"] == sum(c["local_compute"] for c in setup["engines"].values())
    a, b = result["setups"]["disaggregated"], result["setups"]["colocated"]
    assert a["engines"]["prefill"]["prompt"] == a["engines"]["decode"]["prompt"] == prompt_tokens
    assert a["engines"]["decode"]["external_kv_transfer"] > 0  # the decode engine loaded prefixes from the pool
    assert sum(e["prompt"] for e in b["engines"].values()) == prompt_tokens
    assert 0 < a["prefill_tokens_computed"] and 0 < b["prefill_tokens_computed"]
    overhead = a["router_overhead"]
    assert overhead["rounds"][0]["pairs"] == 2
    # one round: the p50 over every pair is that round's own
    assert overhead["added_ttft_p50_all_pairs_ms"] == overhead["rounds"][0]["added_p50_ms"] is not None
    assert set(result["ratios"]) >= {"prefill_tokens_computed", "ttft_p50", "tbt_p90", "meet_both_slos"}
    assert result["machine"]["nproc"] >= 1 and len(result["targets"]) == 2


def test_a_missing_trace_is_a_clear_error(tmp_path):
    from bench import serve

    with pytest.raises(SystemExit) as exit_info:
        serve.main(["--trace", str(tmp_path / "none.jsonl")])
    assert "cannot read the trace" in str(exit_info.value)
