"""Cost per operation of each eviction policy at store scale.

``python -m bench.policy_ops [--blocks 1000000] [--json] [--seed 0]``

For each policy: add N keys, touch N random keys, discard N/2 distinct keys,
then pop the remaining N/2 victims. Keys are shaped like the store's,
``(namespace, 16-byte block hash)``, and generated before timing; the figures
include the Python loop that calls the policy, as the store's would.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time

from kvstore.policy import POLICIES, make_policy

PHASES = ("add_ns", "touch_ns", "discard_ns", "pop_ns")


def make_workload(blocks: int, seed: int) -> dict:
    """Keys, depths, touch sequence and discard set, identical for every policy."""
    rng = random.Random(seed)
    keys = [("bench", rng.randbytes(16)) for _ in range(blocks)]
    depths = [i % 64 for i in range(blocks)]  # chains of 64 blocks
    touches = [keys[rng.randrange(blocks)] for _ in range(blocks)]
    discards = rng.sample(keys, blocks // 2)
    return {"keys": keys, "depths": depths, "touches": touches, "discards": discards}


def run_policy(name: str, work: dict) -> dict[str, float]:
    """Time each phase on a fresh policy; ns per operation."""
    policy = make_policy(name)
    add, touch, discard, pop = policy.add, policy.touch, policy.discard, policy.pop_victim
    result: dict[str, float] = {}
    gc.collect()

    t0 = time.perf_counter_ns()
    for k, d in zip(work["keys"], work["depths"]):
        add(k, depth=d)
    result["add_ns"] = (time.perf_counter_ns() - t0) / len(work["keys"])

    t0 = time.perf_counter_ns()
    for k in work["touches"]:
        touch(k)
    result["touch_ns"] = (time.perf_counter_ns() - t0) / len(work["touches"])

    t0 = time.perf_counter_ns()
    for k in work["discards"]:
        discard(k)
    result["discard_ns"] = (time.perf_counter_ns() - t0) / max(1, len(work["discards"]))

    remaining = len(policy)
    t0 = time.perf_counter_ns()
    popped = 0
    while pop() is not None:
        popped += 1
    result["pop_ns"] = (time.perf_counter_ns() - t0) / max(1, popped)
    assert popped == remaining, (name, popped, remaining)
    return result


def format_table(results: dict[str, dict[str, float]], blocks: int) -> str:
    """A readable table: one row per policy, ns/op per phase."""
    lines = [
        f"eviction policy cost, {blocks:,} blocks (ns/op)",
        f"{'policy':<14}" + "".join(f"{p[:-3]:>10}" for p in PHASES),
    ]
    for name, row in results.items():
        lines.append(f"{name:<14}" + "".join(f"{row[p]:>10.0f}" for p in PHASES))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.policy_ops", description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1_000_000, help="number of keys N (default 1,000,000)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    args = parser.parse_args(argv)

    work = make_workload(args.blocks, args.seed)
    results = {name: run_policy(name, work) for name in POLICIES}
    if args.json:
        print(json.dumps({n: {p: round(v, 1) for p, v in r.items()} for n, r in results.items()}))
    else:
        print(format_table(results, args.blocks))


if __name__ == "__main__":
    main()
