"""The vLLM connector's scheduler-side bookkeeping, keys and settings, without an engine."""

from __future__ import annotations

import pytest

from kvstore_client.errors import ConfigError
from kvstore_client.vllm.naming import KVLayout, PoolNaming, model_tag
from kvstore_client.vllm.plans import RequestPlans
from kvstore_client.vllm.settings import read_settings

BS = 4


def hashes(n: int, tag: str = "r") -> list[bytes]:
    return [f"{tag}{i}".encode().ljust(32, b"\0") for i in range(n)]


def plans(**switches) -> RequestPlans:
    return RequestPlans(BS, **{"load": True, "save": True, "save_decode": False, **switches})


def test_a_hit_loads_the_blocks_past_vllms_own_hit_in_the_first_step():
    p = plans()
    p.remember_hit("a", pool_blocks=5, num_computed_tokens=2 * BS)
    assert p.external_tokens(5, 2 * BS, 6 * BS + 1) == 3 * BS
    p.allocated("a", hashes(6), prompt_len=6 * BS + 1, num_external_tokens=3 * BS)
    plan = p.step([("a", list(range(10, 17)), 5 * BS)], [], {"a": BS + 1})
    assert [(t.block_ids, t.first_index) for t in plan.loads] == [([12, 13, 14], 2)]
    assert plan.loads[0].hashes == hashes(6)[2:5]
    # the step computes block 5 (the prompt's last full block): only it is saved
    assert [(t.block_ids, t.first_index) for t in plan.saves] == [([15], 5)]
    assert p.step([], [("a", None, False, 6 * BS + 1)], {"a": 1}).loads == []


def test_at_least_one_prompt_token_is_left_to_compute():
    p = plans()
    assert p.full_blocks(4 * BS) == 4 and p.full_blocks(4 * BS - 1) == 3 and p.full_blocks(0) == 0
    assert p.external_tokens(4, 0, 4 * BS + 1) == 4 * BS  # a partial block follows: all four load
    assert p.external_tokens(4, 0, 4 * BS) == 4 * BS - 1  # only full blocks: vLLM computes the last token
    assert p.external_tokens(4, 3 * BS, 4 * BS) == BS - 1
    assert p.external_tokens(4, 0, 1) == 0


def test_a_prompt_of_full_blocks_loads_its_last_block_whole():
    p = plans()
    p.remember_hit("a", 4, 0)
    p.allocated("a", hashes(4), prompt_len=4 * BS, num_external_tokens=p.external_tokens(4, 0, 4 * BS))
    plan = p.step([("a", [9, 8, 7, 6], 0)], [], {"a": 1})
    assert [(t.block_ids, t.first_index) for t in plan.loads] == [([9, 8, 7, 6], 0)]
    assert plan.saves == []  # all four are in the pool already


def test_a_request_the_pool_could_not_be_asked_about_is_never_saved():
    """Its lookup ran out of budget: a save would wait on the same master."""
    p = plans()
    p.remember_hit("a", 0, 0, reachable=False)
    p.remember_hit("b", 0, 0)
    p.allocated("a", hashes(3, "a"), prompt_len=3 * BS, num_external_tokens=0)
    p.allocated("b", hashes(3, "b"), prompt_len=3 * BS, num_external_tokens=0)
    step = p.step([("a", [0, 1, 2], 0), ("b", [3, 4, 5], 0)], [], {"a": 3 * BS, "b": 3 * BS})
    assert [t.req_id for t in step.saves] == ["b"]


def test_chunked_prefill_saves_each_block_once_as_it_fills():
    p = plans()
    p.remember_hit("a", 0, 0)
    p.allocated("a", hashes(5), prompt_len=5 * BS + 2, num_external_tokens=0)
    blocks = list(range(6))
    first = p.step([("a", blocks[:3], 0)], [], {"a": 2 * BS + 3})
    assert [t.block_ids for t in first.saves] == [[0, 1]]
    second = p.step([], [("a", blocks[3:], False, 2 * BS + 3)], {"a": 3 * BS - 1})
    assert [(t.block_ids, t.first_index) for t in second.saves] == [([2, 3, 4], 2)]
    decode = p.step([], [("a", None, False, 5 * BS + 2)], {"a": 1})
    assert decode.saves == [] and decode.loads == []


def test_decode_blocks_are_saved_only_when_asked_and_never_from_draft_tokens():
    for save_decode, expected in ((False, []), (True, [[2]])):
        p = plans(save_decode=save_decode)
        p.remember_hit("a", 0, 0)
        p.allocated("a", hashes(3), prompt_len=2 * BS, num_external_tokens=0)
        p.step([("a", [0, 1], 0)], [], {"a": 2 * BS})
        # decode fills block 2 with generated tokens, two of them drafts
        assert [t.block_ids for t in p.step([], [("a", [2], False, 2 * BS)], {"a": 3}, {"a": 2}).saves] == []
        plan = p.step([], [("a", None, False, 2 * BS + 1)], {"a": BS - 1})
        assert [t.block_ids for t in plan.saves] == expected


def test_blocks_the_pool_already_has_are_not_saved_again():
    p = plans()
    p.remember_hit("a", 3, 3 * BS)  # vLLM had them all locally; the pool too
    p.allocated("a", hashes(4), prompt_len=4 * BS + 1, num_external_tokens=0)
    plan = p.step([("a", [0, 1, 2, 3, 4], 3 * BS)], [], {"a": BS + 1})
    assert plan.loads == [] and [t.block_ids for t in plan.saves] == [[3]]


def test_switches_and_roles():
    no_load = plans(load=False)
    assert no_load.external_tokens(5, 0, 9 * BS) == 0
    no_save = plans(save=False)
    no_save.remember_hit("a", 0, 0)
    no_save.allocated("a", hashes(2), prompt_len=2 * BS, num_external_tokens=0)
    assert no_save.step([("a", [0, 1], 0)], [], {"a": 2 * BS}).saves == []


def test_a_resumed_request_replaces_its_blocks_and_loads_again():
    p = plans()
    p.remember_hit("a", 2, 0)
    p.allocated("a", hashes(3), prompt_len=3 * BS + 1, num_external_tokens=2 * BS)
    p.step([("a", [7, 8, 9, 10], 0)], [], {"a": BS + 1})
    # preempted, then scheduled again with new blocks and a fresh lookup
    p.remember_hit("a", 3, 0)
    p.allocated("a", hashes(3), prompt_len=3 * BS + 1, num_external_tokens=3 * BS)
    plan = p.step([], [("a", [1, 2, 3, 4], True, 0)], {"a": 1})
    assert [t.block_ids for t in plan.loads] == [[1, 2, 3]]
    assert plan.saves == []


def test_finished_requests_leave_no_state():
    p = plans()
    p.remember_hit("a", 1, 0)
    p.remember_hit("b", 0, 0)
    p.allocated("a", hashes(2), prompt_len=2 * BS, num_external_tokens=BS)
    assert p.tracked() == 2
    p.finished("a")
    p.finished("b")  # looked up, never allocated (e.g. aborted while waiting)
    p.finished("never-seen")
    assert p.tracked() == 0


def test_unknown_requests_in_a_step_are_ignored():
    assert plans().step([("x", [1], 0)], [("y", [2], False, 0)], {"x": 4, "y": 4}).saves == []


TAIL = b"t".ljust(32, b"\0")


def test_the_tail_is_saved_once_in_the_step_that_computes_the_prompts_last_token():
    p = plans()
    p.remember_hit("a", 0, 0, tail=TAIL)
    p.allocated("a", hashes(2), prompt_len=2 * BS + 3, num_external_tokens=0)
    first = p.step([("a", [5, 6], 0)], [], {"a": 2 * BS})  # chunked: the full blocks only
    assert [(t.block_ids, t.hashes, t.first_index) for t in first.saves] == [([5, 6], hashes(2), 0)]
    last = p.step([], [("a", [7], False, 2 * BS)], {"a": 3})
    assert [(t.block_ids, t.hashes, t.first_index) for t in last.saves] == [([7], [TAIL], 2)]
    assert p.step([], [("a", None, False, 2 * BS + 3)], {"a": 1}).saves == []  # decode: not again


def test_a_tail_hit_loads_all_but_the_prompts_last_token():
    p = plans()
    prompt_len = 3 * BS + 2
    p.remember_hit("a", 4, BS, tail=TAIL)  # three full blocks and the tail; vLLM holds block 0
    assert p.external_tokens(4, BS, prompt_len) == prompt_len - 1 - BS
    p.allocated("a", hashes(3), prompt_len, num_external_tokens=prompt_len - 1 - BS)
    plan = p.step([("a", [9, 8, 7, 6], prompt_len - 1)], [], {"a": 1})
    assert [(t.block_ids, t.hashes, t.first_index) for t in plan.loads] == [([8, 7, 6], hashes(3)[1:] + [TAIL], 1)]
    assert plan.saves == []  # the pool has every block, the tail too


def test_a_tail_miss_loads_the_full_blocks_only_and_saves_the_tail():
    p = plans()
    prompt_len = 3 * BS + 2
    p.remember_hit("a", 3, 0, tail=TAIL)
    assert p.external_tokens(3, 0, prompt_len) == 3 * BS
    p.allocated("a", hashes(3), prompt_len, num_external_tokens=3 * BS)
    plan = p.step([("a", [1, 2, 3, 4], 3 * BS)], [], {"a": 2})
    assert [(t.block_ids, t.hashes) for t in plan.loads] == [([1, 2, 3], hashes(3))]
    assert [(t.block_ids, t.hashes, t.first_index) for t in plan.saves] == [([4], [TAIL], 3)]


def test_a_decode_filled_tail_block_is_saved_under_its_own_hash_too():
    p = plans(save_decode=True)
    p.remember_hit("a", 0, 0, tail=TAIL)
    p.allocated("a", hashes(2), prompt_len=BS + 2, num_external_tokens=0)
    prompt = p.step([("a", [3, 4], 0)], [], {"a": BS + 2})
    assert [(t.block_ids, t.hashes, t.first_index) for t in prompt.saves] == [([3], hashes(1), 0), ([4], [TAIL], 1)]
    filled = p.step([], [("a", None, False, BS + 2)], {"a": BS - 2})
    assert [(t.block_ids, t.hashes, t.first_index) for t in filled.saves] == [([4], hashes(2)[1:], 1)]


def test_without_a_tail_nothing_past_the_full_blocks_moves():
    # what the connector passes for a one-token tail, for partial_blocks off, and for multimodal prompts
    p = plans()
    p.remember_hit("a", 2, 0)
    assert p.external_tokens(2, 0, 2 * BS + 1) == 2 * BS  # the one token left is vLLM's to compute anyway
    p.allocated("a", hashes(2), prompt_len=2 * BS + 1, num_external_tokens=2 * BS)
    plan = p.step([("a", [1, 2, 3], 2 * BS)], [], {"a": 1})
    assert [t.block_ids for t in plan.loads] == [[1, 2]] and plan.saves == []


def test_the_partial_blocks_setting():
    from kvstore_client.vllm_hashing import prompt_tail

    assert read_settings({"master": "h:1"}, "kv_both").partial_blocks is True
    assert read_settings({"master": "h:1", "partial_blocks": "false"}, "kv_both").partial_blocks is False
    with pytest.raises(ConfigError, match="partial_blocks"):
        read_settings({"master": "h:1", "partial_blocks": "sometimes"}, "kv_both")
    # which prompts have a tail: a full block before it, and two tokens at least
    assert prompt_tail(list(range(2 * BS + 2)), BS) == (2 * BS, 2 * BS + 1)
    assert prompt_tail(list(range(2 * BS + 1)), BS) is None
    assert prompt_tail(list(range(2 * BS)), BS) is None
    assert prompt_tail(list(range(BS - 1)), BS) is None


LAYOUT = KVLayout(
    model="/models/Llama-3-8B/",
    revision="",
    kv_dtype="torch.bfloat16/auto",
    block_size=16,
    num_kv_heads=8,
    head_size=128,
    num_layers=3,
    tp_size=2,
    device="cpu",
    hash_algo="sha256",
)


def test_each_rank_has_its_own_namespace_and_hashes_are_the_digests():
    rank0, rank1 = PoolNaming("acme", LAYOUT, 0), PoolNaming("acme", LAYOUT, 1)
    assert rank0.namespace != rank1.namespace
    assert rank0.namespace.startswith("acme/Llama-3-8B-") and rank0.namespace.count("/") == 1
    assert rank0.keys([b"h1", b"h2"]) == [(rank0.namespace, b"h1"), (rank0.namespace, b"h2")]
    assert rank0.layers == 3


def test_an_mla_model_shares_one_namespace_across_ranks_and_parallel_sizes():
    from dataclasses import replace

    mla = replace(LAYOUT, mla=True, num_kv_heads=1, head_size=576)
    names = {PoolNaming("acme", replace(mla, tp_size=tp), rank).namespace for tp in (1, 2, 8) for rank in range(tp)}
    assert len(names) == 1
    assert (
        PoolNaming("acme", mla).namespace
        != PoolNaming("acme", replace(LAYOUT, num_kv_heads=1, head_size=576)).namespace
    )


def test_the_value_format_is_in_every_fingerprint(monkeypatch):
    from kvstore_client.vllm import naming

    before = PoolNaming("acme", LAYOUT).namespace
    monkeypatch.setattr(naming, "VALUE_FORMAT", "another")
    assert PoolNaming("acme", LAYOUT).namespace != before


@pytest.mark.parametrize(
    "field,value",
    [
        ("model", "other"),
        ("revision", "main"),
        ("kv_dtype", "torch.float32/auto"),
        ("block_size", 32),
        ("num_kv_heads", 4),
        ("head_size", 64),
        ("num_layers", 4),
        ("tp_size", 1),
        ("device", "cuda"),
        ("hash_algo", "sha256_cbor"),
    ],
)
def test_anything_that_changes_the_bytes_changes_the_namespace(field, value):
    from dataclasses import replace

    assert PoolNaming("vllm", replace(LAYOUT, **{field: value})).namespace != PoolNaming("vllm", LAYOUT).namespace


def test_model_tags_are_short_and_tame():
    assert model_tag("meta-llama/Llama-3.1-8B-Instruct") == "Llama-3.1-8B-Instruct"
    assert model_tag("/tmp/x y:z/") == "x_y_z"
    assert len(model_tag("m" * 300)) == 32


def test_settings_from_the_extra_config():
    s = read_settings({"master": "h:1", "namespace": "acme", "save_decode": "true", "timeout": 3}, "kv_both")
    assert (s.master, s.namespace, s.load, s.save, s.save_decode, s.timeout) == ("h:1", "acme", True, True, True, 3.0)
    assert read_settings({"master": "h:1"}, "kv_producer").load is False
    assert read_settings({"master": "h:1"}, "kv_consumer").save is False
    assert read_settings({"master": "h:1", "load": False}, "kv_both").load is False


@pytest.mark.parametrize(
    "extra,role,message",
    [
        ({}, "kv_both", "needs 'master'"),
        ({"master": "nohostport"}, "kv_both", "needs 'master'"),
        ({"master": "h:1", "colour": "red"}, "kv_both", "unknown kv_connector_extra_config keys"),
        ({"master": "h:1", "load": "maybe"}, "kv_both", "must be true or false"),
        ({"master": "h:1", "namespace": "a/b"}, "kv_both", "may not contain '/'"),
        ({"master": "h:1", "namespace": ""}, "kv_both", "namespace"),
        ({"master": "h:1", "timeout": "soon"}, "kv_both", "must be a number"),
        ({"master": "h:1", "timeout": 0}, "kv_both", "must be positive"),
        ({"master": "h:1"}, None, "kv_role must be"),
    ],
)
def test_unusable_settings_are_config_errors(extra, role, message):
    with pytest.raises(ConfigError, match=message):
        read_settings(extra, role)
