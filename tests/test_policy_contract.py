"""Contract of EvictionPolicy, run against every policy, then each policy's order.

The contract part checks only the interface (membership, draining, no-ops);
the order part checks each policy's documented victim order, also against a
naive O(n) reference model over long random operation sequences.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.policy import POLICIES, make_policy
from kvstore.policy.heap import PriorityPolicy

ALL = sorted(POLICIES)
HEAP_POLICIES = sorted(n for n, cls in POLICIES.items() if issubclass(cls, PriorityPolicy))


def key(i: int) -> tuple[str, bytes]:
    """A key shaped like the store's: (namespace, 16-byte block hash)."""
    return ("ns", i.to_bytes(16, "little"))


def drain(policy) -> list:
    out = []
    while (victim := policy.pop_victim()) is not None:
        out.append(victim)
    return out


# --- contract: every policy ------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_name_matches_registry(name):
    assert make_policy(name).name == name


@pytest.mark.parametrize("name", ALL)
def test_len_and_contains_follow_add_and_discard(name):
    p = make_policy(name)
    assert len(p) == 0 and key(1) not in p
    p.add(key(1), depth=0, hits=0)
    p.add(key(2), depth=3, hits=2)
    assert len(p) == 2 and key(1) in p and key(2) in p
    p.discard(key(1))
    assert len(p) == 1 and key(1) not in p and key(2) in p
    p.discard(key(2))
    assert len(p) == 0 and key(2) not in p


@pytest.mark.parametrize("name", ALL)
def test_pop_drains_every_candidate_once_then_none(name):
    p = make_policy(name)
    keys = [key(i) for i in range(50)]
    for i, k in enumerate(keys):
        p.add(k, depth=i % 7, hits=i % 3)
    for k in keys[::3]:
        p.touch(k)
    victims = drain(p)
    assert sorted(victims) == sorted(keys)
    assert len(p) == 0
    assert p.pop_victim() is None
    assert p.pop_victim() is None


@pytest.mark.parametrize("name", ALL)
def test_empty_policy_pops_none(name):
    assert make_policy(name).pop_victim() is None


@pytest.mark.parametrize("name", ALL)
def test_discard_of_unknown_key_is_noop(name):
    p = make_policy(name)
    p.discard(key(9))
    p.add(key(1))
    p.discard(key(9))
    assert len(p) == 1 and drain(p) == [key(1)]


@pytest.mark.parametrize("name", ALL)
def test_touch_of_unknown_key_is_noop(name):
    p = make_policy(name)
    p.touch(key(9))
    assert len(p) == 0 and key(9) not in p and p.pop_victim() is None
    p.add(key(1))
    p.touch(key(9))
    assert len(p) == 1 and drain(p) == [key(1)]


@pytest.mark.parametrize("name", ALL)
def test_add_of_existing_key_does_not_duplicate(name):
    p = make_policy(name)
    p.add(key(1), depth=2, hits=1)
    p.add(key(1), depth=2, hits=1)
    p.add(key(1), depth=5, hits=9)
    assert len(p) == 1
    assert drain(p) == [key(1)]


@pytest.mark.parametrize("name", ALL)
def test_discarded_key_is_never_popped(name):
    p = make_policy(name)
    for i in range(20):
        p.add(key(i), depth=i, hits=0)
    p.touch(key(5))
    p.discard(key(5))
    p.discard(key(0))
    victims = drain(p)
    assert key(5) not in victims and key(0) not in victims
    assert len(victims) == 18


@pytest.mark.parametrize("name", ALL)
def test_readd_after_pop_is_a_fresh_candidate(name):
    p = make_policy(name)
    p.add(key(1))
    assert p.pop_victim() == key(1)
    p.add(key(1), hits=3)
    assert key(1) in p and len(p) == 1 and drain(p) == [key(1)]


OPS = st.lists(
    st.tuples(
        st.sampled_from(["add", "touch", "discard", "pop"]),
        st.integers(0, 11),  # key index: a small pool so ops collide
        st.integers(0, 5),  # depth
        st.integers(0, 3),  # hits
    ),
    max_size=120,
)


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=60, deadline=None)
@given(ops=OPS)
def test_random_ops_match_candidate_set(name, ops):
    p = make_policy(name)
    model: set = set()
    for op, i, depth, hits in ops:
        k = key(i)
        if op == "add":
            p.add(k, depth=depth, hits=hits)
            model.add(k)
        elif op == "touch":
            p.touch(k)
        elif op == "discard":
            p.discard(k)
            model.discard(k)
        else:
            victim = p.pop_victim()
            if model:
                assert victim in model
                model.remove(victim)
            else:
                assert victim is None
        assert len(p) == len(model)
        assert all(k in p for k in model)
    assert set(drain(p)) == model


# --- order: each policy ----------------------------------------------------


def test_lru_evicts_least_recent_and_touch_moves_to_back():
    p = make_policy("lru")
    for i in range(5):
        p.add(key(i))
    p.touch(key(0))
    p.add(key(2))  # re-add counts as a touch
    assert drain(p) == [key(1), key(3), key(4), key(0), key(2)]


def test_lru_ignores_hits_and_depth():
    p = make_policy("lru")
    p.add(key(0), hits=100, depth=0)
    p.add(key(1), hits=0, depth=50)
    assert drain(p) == [key(0), key(1)]


def test_lfu_evicts_lowest_count_with_recency_tiebreak():
    p = make_policy("lfu")
    for i in range(4):
        p.add(key(i))
    p.touch(key(0))
    p.touch(key(0))
    p.touch(key(2))
    p.touch(key(1))  # 1 and 2 both at count 1; 2 was touched earlier
    assert drain(p) == [key(3), key(2), key(1), key(0)]


def test_lfu_honours_hits_given_to_add():
    p = make_policy("lfu")
    p.add(key(0))
    assert p.pop_victim() == key(0)
    p.add(key(0), hits=5)  # re-added with its statistics, e.g. after a read lease
    for i in range(1, 6):
        p.add(key(i))
        p.touch(key(i))  # fresh keys with one access each
    victims = drain(p)
    assert victims[-1] == key(0)
    assert victims[:-1] == [key(i) for i in range(1, 6)]


def test_lfu_add_is_not_an_access():
    p = make_policy("lfu")
    p.add(key(0), hits=1)
    p.add(key(1), hits=0)
    p.add(key(2), hits=0)
    p.touch(key(2))  # now 1, like key 0, but more recent
    assert drain(p) == [key(1), key(0), key(2)]


def test_length_aware_evicts_deeper_first_among_equal_counts():
    p = make_policy("length_aware")
    p.add(key(0), depth=0)
    p.add(key(1), depth=1)
    p.add(key(2), depth=2)
    p.add(key(3), depth=2)  # same depth as key 2, more recent
    assert drain(p) == [key(2), key(3), key(1), key(0)]


def test_length_aware_lower_count_goes_before_depth():
    p = make_policy("length_aware")
    p.add(key(0), depth=0, hits=0)
    p.add(key(1), depth=9, hits=1)
    p.add(key(2), depth=5, hits=0)
    p.touch(key(2))  # count 1, shallower than key 1
    assert drain(p) == [key(0), key(1), key(2)]


def test_length_aware_depth_survives_touch():
    p = make_policy("length_aware")
    p.add(key(0), depth=8)
    p.add(key(1), depth=1)
    p.touch(key(0))
    p.touch(key(1))
    assert drain(p) == [key(0), key(1)]


def test_length_aware_huge_depth_never_outranks_a_lower_count():
    p = make_policy("length_aware")
    p.add(key(0), depth=2**40, hits=1)  # beyond the packed range: clamped
    p.add(key(1), depth=0, hits=0)
    p.add(key(2), depth=2**32 - 1, hits=1)
    p.add(key(3), depth=-3, hits=1)  # nonsense depth counts as 0
    assert drain(p) == [key(1), key(0), key(2), key(3)]


SORT_KEYS = {  # the documented victim order: smallest first
    "lru": lambda hits, depth, tick: (tick,),
    "lfu": lambda hits, depth, tick: (hits, tick),
    "length_aware": lambda hits, depth, tick: (hits, -depth, tick),
}


def test_every_policy_has_a_reference_order():
    assert set(SORT_KEYS) == set(POLICIES)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_order_matches_reference_model(name, seed):
    """Long random runs (heap compaction included) agree with a naive O(n) model."""
    rng = random.Random(seed)
    p = make_policy(name)
    rank = SORT_KEYS[name]
    model: dict = {}  # key -> [hits, depth, tick]
    tick = 0
    for _ in range(6000):
        op = rng.choices(["add", "touch", "discard", "pop"], weights=[3, 6, 1, 2])[0]
        k = key(rng.randrange(40))
        tick += 1
        if op == "add":
            depth, hits = rng.randrange(6), rng.randrange(4)
            p.add(k, depth=depth, hits=hits)
            if k in model:
                model[k][0] += 1
                model[k][2] = tick
            else:
                model[k] = [hits, depth, tick]
        elif op == "touch":
            p.touch(k)
            if k in model:
                model[k][0] += 1
                model[k][2] = tick
        elif op == "discard":
            p.discard(k)
            model.pop(k, None)
        else:
            expected = min(model, key=lambda m: rank(*model[m])) if model else None
            assert p.pop_victim() == expected
            model.pop(expected, None)
    expected_all = sorted(model, key=lambda m: rank(*model[m]))
    assert drain(p) == expected_all


@pytest.mark.parametrize("name", HEAP_POLICIES)
def test_heap_memory_stays_bounded(name):
    rng = random.Random(7)
    p = make_policy(name)
    keys = [key(i) for i in range(1000)]
    for i, k in enumerate(keys):
        p.add(k, depth=i % 32)
    for _ in range(100_000):
        p.touch(keys[rng.randrange(1000)])
    assert len(p) == 1000
    assert p.heap_size < 4 * len(p)
    for k in keys[:900]:
        p.discard(k)
    assert p.heap_size < 4 * len(p) + PriorityPolicy.COMPACT_SLACK
    assert sorted(drain(p)) == sorted(keys[900:])
    assert p.heap_size == 0
