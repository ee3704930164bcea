"""bench.hit_rate agrees with an independent replay of the same rules, at every capacity it reports.

The reference below shares no code with the project's policies or store: plain
dicts and a heap. Its rules, which bench.hit_rate must follow:

- requests in timestamp order; a request hits its longest stored prefix;
- the hit blocks are read, one access each (hits + 1, most recent);
- the request's missing blocks are stored in chain order, hits 0, with their
  depth; a block already stored out of prefix order is left alone;
- the victim is the stored block with the smallest rank: LRU (last access),
  LFU (hits, last access), length-aware (hits, -depth, last access); blocks
  the ongoing request has read or written are not candidates (Mooncake,
  section 3.2.1); when only those are left, the request stores no more.

The real-trace case runs when ``KVSTORE_HIT_RATE_TRACE`` names the Mooncake
conversation trace (the file ``python -m bench.hit_rate --trace`` reads); it is
skipped otherwise, and takes a few minutes.
"""

from __future__ import annotations

import heapq
import itertools
import os
import random

import pytest

from bench import hit_rate

POLICY_NAMES = ("lru", "lfu", "length_aware")
TOLERANCE = 0.002
TRACE_ENV = "KVSTORE_HIT_RATE_TRACE"


def reference_hit_ratio(requests: list[dict], policy: str, capacity: int | None, spare_request: bool = True) -> float:
    """Prefix hit ratio under the rules in the module docstring (``spare_request=False``:
    without sparing the ongoing request's blocks)."""
    cap = float("inf") if capacity is None else capacity
    state: dict = {}  # block -> [hits, depth, last access]
    heap: list = []  # (rank, block); an entry is stale when its rank is no longer the block's
    clock = itertools.count()

    def rank(block):
        hits, depth, last = state[block]
        return {"lru": (last,), "lfu": (hits, last), "length_aware": (hits, -depth, last)}[policy]

    hit = total = 0
    for request in sorted(requests, key=lambda r: r["timestamp"]):
        blocks = request["hash_ids"]
        matched = 0
        while matched < len(blocks) and blocks[matched] in state:
            matched += 1
        ongoing = set()
        for block in blocks[:matched]:
            state[block][0] += 1
            state[block][2] = next(clock)
            heapq.heappush(heap, (rank(block), block))
            ongoing.add(block)
        for depth in range(matched, len(blocks)):
            block = blocks[depth]
            if block in state:
                continue
            spared = []
            while len(state) >= cap and heap:
                entry = heapq.heappop(heap)
                victim = entry[1]
                if victim not in state or rank(victim) != entry[0]:
                    continue
                if spare_request and victim in ongoing:
                    spared.append(entry)
                else:
                    del state[victim]
            for entry in spared:
                heapq.heappush(heap, entry)
            if len(state) >= cap:
                break
            state[block] = [0, depth, next(clock)]
            heapq.heappush(heap, (rank(block), block))
            ongoing.add(block)
        hit += matched
        total += len(blocks)
    return hit / total if total else 0.0


def conversation_trace(seed: int = 1, conversations: int = 60, prompts: int = 4, prompt_blocks: int = 16) -> list[dict]:
    """Seeded conversation-like requests: a shared system prompt, then each turn extends
    its conversation's history by a few blocks; conversations interleave."""
    rng = random.Random(seed)
    ids = itertools.count()
    system = [[next(ids) for _ in range(prompt_blocks)] for _ in range(prompts)]
    active: list = []
    requests: list[dict] = []
    pending = conversations
    while pending or active:
        if pending and (not active or rng.random() < 0.3):
            active.append([rng.choice(system), [], rng.randint(1, 6)])
            pending -= 1
        conv = rng.choice(active)
        conv[1] += [next(ids) for _ in range(rng.randint(4, 24))]
        requests.append({"timestamp": len(requests), "hash_ids": conv[0] + conv[1]})
        conv[2] -= 1
        if conv[2] == 0:
            active.remove(conv)
    return requests


def check_against_reference(requests: list[dict], policy: str) -> None:
    """Every capacity bench.hit_rate reports, within TOLERANCE."""
    for text in hit_rate.CAPACITIES:
        capacity = hit_rate.parse_capacity(text)
        got = hit_rate.replay(requests, policy, capacity)["prefix_hit_ratio"]
        want = reference_hit_ratio(requests, policy, capacity)
        assert got == pytest.approx(want, abs=TOLERANCE), (
            f"{policy} at {text} blocks: bench {got:.4f}, reference {want:.4f}"
        )


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_bench_matches_reference_on_synthetic_trace(policy):
    requests = conversation_trace()
    check_against_reference(requests, policy)
    if policy != "lru":  # the trace tells the rules apart: fresh blocks are LFU's first victims
        spared = reference_hit_ratio(requests, policy, 1000)
        assert spared - reference_hit_ratio(requests, policy, 1000, spare_request=False) > 0.05


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_bench_matches_reference_on_real_trace(policy):
    path = os.environ.get(TRACE_ENV)
    if not path or not os.path.exists(path):
        pytest.skip(f"set {TRACE_ENV} to the conversation trace (JSONL) to run this")
    check_against_reference(hit_rate.load_trace(path), policy)


def test_reference_counts_a_hand_worked_trace():
    # capacity 3, LFU: request 2 reads 0 and 1, so storing 3 must evict 2 (never read).
    trace = [
        {"timestamp": 0, "hash_ids": [0, 1, 2]},
        {"timestamp": 1, "hash_ids": [0, 1, 3]},
        {"timestamp": 2, "hash_ids": [0, 1, 2]},
    ]
    assert reference_hit_ratio(trace, "lfu", 3) == pytest.approx(4 / 9)
    # capacity 2, one request of 3 fresh blocks: its own blocks are never victims, it stores 2.
    long = [{"timestamp": 0, "hash_ids": [0, 1, 2]}, {"timestamp": 1, "hash_ids": [0, 1, 2]}]
    for policy in POLICY_NAMES:
        assert reference_hit_ratio(long, policy, 2) == pytest.approx(2 / 6)
