"""The scheduler's prefix lookup policy (kvstore_client.vllm.lookup): a budget per lookup, a
miss past it, a pause after repeated failures that doubles while they go on, and lookups again
once the pool answers. On a clock of the test's own, with a pool that fails on demand."""

from __future__ import annotations

import logging

from kvstore_client.errors import ServiceUnavailable
from kvstore_client.vllm.lookup import FIRST_BACKOFF, LOOKUP_FAILURES, MAX_BACKOFF, PrefixLookup


class Pool:
    def __init__(self):
        self.down, self.asked = False, []

    def match(self, keys, timeout):
        self.asked.append(timeout)
        if self.down:
            raise ServiceUnavailable("master is unreachable: DEADLINE_EXCEEDED")
        return len(keys) - 1


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_each_lookup_gets_the_budget_and_answers_what_the_pool_holds():
    pool, clock = Pool(), Clock()
    lookup = PrefixLookup(pool.match, 0.004, clock)
    assert lookup(["a", "b", "c"]) == 2 and pool.asked == [0.004]
    assert lookup([]) == 0 and pool.asked == [0.004]  # nothing to ask


def test_failures_are_misses_then_the_pool_is_left_alone_for_a_while(caplog):
    pool, clock = Pool(), Clock()
    lookup = PrefixLookup(pool.match, 0.01, clock)
    pool.down = True
    with caplog.at_level(logging.WARNING):
        for _ in range(LOOKUP_FAILURES):
            assert lookup(["a", "b"]) is None
        assert len(pool.asked) == LOOKUP_FAILURES and lookup.backing_off
        for _ in range(50):
            assert lookup(["a", "b"]) is None  # not asked at all
        assert len(pool.asked) == LOOKUP_FAILURES and lookup.skipped == 50
        clock.now += FIRST_BACKOFF + 0.01
        assert lookup(["a", "b"]) is None  # asked once more: still down, so a longer pause
        assert len(pool.asked) == LOOKUP_FAILURES + 1
        clock.now += FIRST_BACKOFF + 0.01
        assert lookup(["a", "b"]) is None and len(pool.asked) == LOOKUP_FAILURES + 1  # doubled
        clock.now += FIRST_BACKOFF
        pool.down = False
        assert lookup(["a", "b"]) == 1 and not lookup.backing_off
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2  # once when it started, once when lookups answered again
    assert "computing without the pool" in warnings[0] and "answer again" in warnings[1]


def test_the_pause_grows_to_a_cap_and_starts_over_after_an_answer():
    pool, clock = Pool(), Clock()
    lookup = PrefixLookup(pool.match, 0.01, clock)
    pool.down = True
    pauses = []
    for _ in range(12):
        while not lookup.backing_off:
            lookup(["a"])
        start = clock.now
        while lookup.backing_off:
            clock.now += 0.25
        pauses.append(clock.now - start)
    assert pauses[0] <= FIRST_BACKOFF + 0.25 and max(pauses) <= MAX_BACKOFF + 0.25
    assert pauses[-1] >= MAX_BACKOFF  # capped, not growing further
    pool.down = False
    assert lookup(["a", "b"]) == 1
    pool.down = True
    for _ in range(LOOKUP_FAILURES):
        lookup(["a"])
    start = clock.now
    while lookup.backing_off:
        clock.now += 0.25
    assert clock.now - start <= FIRST_BACKOFF + 0.25  # from the first pause again
