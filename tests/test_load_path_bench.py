"""bench.vllm_reuse --load-path-only at a real model's KV geometry runs end to end, small: both
value formats move the same bytes through a real pool, and the report says what the issue's
targets need (values per block, bytes a value, the master's memory per byte of KV)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")


def test_the_load_path_at_llama3_70b_tp8_geometry_runs_small(capsys):
    from bench import vllm_reuse

    vllm_reuse.main(
        ["--load-path-only", "--geometry", "llama3-70b-tp8", "--block-size", "16", "--lengths", "128"]
        + ["--runs", "1", "--fill", "0.02", "--json"]
    )
    result = json.loads(capsys.readouterr().out)
    path = result["load_path"]
    slab = 1 * 16 * 2 * 128 * 2  # one KV head, 16 tokens, K and V of 128, bf16
    assert path["slab_bytes"] == slab == 8192
    assert path["values_per_block_per_rank"] == {"per_layer": 80, "sliced": 1}
    assert path["bytes_a_value"] == {"per_layer": slab, "sliced": 80 * slab + 1024}  # the header: 80 slices
    assert path["rates"]["bytes"] == 80 * 8 * slab
    assert all(rate > 0 for rate in path["rates"]["gbps"].values())
    per_layer, sliced = path["master"]["per_layer"], path["master"]["sliced"]
    assert per_layer["kv_bytes"] == sliced["kv_bytes"] >= 0.02 * (1 << 30)
    assert per_layer["keys"] == 80 * sliced["keys"]
    assert "1 value per block per rank" in result["targets"]


def test_a_block_size_of_16_needs_the_load_path_only(capsys):
    from bench import vllm_reuse

    with pytest.raises(SystemExit) as exit_info:
        vllm_reuse.main(["--block-size", "16", "--lengths", "64"])
    assert exit_info.value.code == 2 and "--load-path-only" in capsys.readouterr().err
