"""Sharded maps behave as the dict and the LRU order they stand in for, and do spread."""

from __future__ import annotations

import os
from collections import OrderedDict

from hypothesis import given
from hypothesis import strategies as st

from kvstore.sharded import SHARDS, ShardedDict, ShardedRecency

KEYS = st.sampled_from([("ns", os.urandom(16)) for _ in range(40)] + list(range(10)) + ["a", "b"])
DICT_OPS = st.lists(
    st.tuples(st.sampled_from(["set", "del", "pop", "get", "clear"]), KEYS, st.integers()), max_size=200
)


@given(DICT_OPS)
def test_sharded_dict_matches_a_dict(ops):
    model, sharded = {}, ShardedDict()
    for op, key, value in ops:
        if op == "set":
            model[key] = sharded[key] = value
        elif op == "del" and key in model:
            del model[key]
            del sharded[key]
        elif op == "pop":
            assert sharded.pop(key, None) == model.pop(key, None)
        elif op == "get":
            assert sharded.get(key) == model.get(key)
        elif op == "clear" and value % 17 == 0:
            model.clear()
            sharded.clear()
        assert len(sharded) == len(model) and bool(sharded) == bool(model)
        assert (key in sharded) == (key in model)
    assert sorted(map(repr, sharded)) == sorted(map(repr, model))
    assert dict(sharded.items()) == model and sorted(map(repr, sharded.values())) == sorted(map(repr, model.values()))
    assert dict(ShardedDict(model.items()).items()) == model


@given(st.lists(st.tuples(st.sampled_from(["add", "touch", "discard", "pop"]), KEYS), max_size=300))
def test_sharded_recency_is_exact_lru(ops):
    model, recency = OrderedDict(), ShardedRecency()
    for op, key in ops:
        if op == "add":
            model[key] = None
            model.move_to_end(key)
            recency.touch(key, add=True)
        elif op == "touch":
            if key in model:
                model.move_to_end(key)
            recency.touch(key, add=False)
        elif op == "discard":
            model.pop(key, None)
            recency.discard(key)
        else:
            assert recency.pop_oldest() == (model.popitem(last=False)[0] if model else None)
        assert len(recency) == len(model) and (key in recency) == (key in model)
    assert [recency.pop_oldest() for _ in range(len(model))] == list(model)
    assert recency.pop_oldest() is None


def test_block_keys_spread_over_every_shard():
    sharded = ShardedDict((("ns", os.urandom(16)), i) for i in range(SHARDS * 200))
    sizes = [len(shard) for shard in sharded._shards]
    assert min(sizes) > 100 and max(sizes) < 300  # about 200 each: no shard holds the store
