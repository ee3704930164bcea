"""Fragmentation of the DRAM arena allocator under churn of mixed block sizes.

    python -m bench.fragmentation --json

Drives the real ExtentAllocator with the real LRU policy, as the DRAM tier
does when full: each new block evicts least-recently-used blocks until a
free extent fits it. No bytes move (the allocator only hands out offsets),
so a large virtual arena and many operations run in seconds. Reports how
full the arena is right after each block lands (utilisation: what is not
used is lost to fragmentation, since LRU evicts only until the block fits),
and the share of free space outside the largest free extent.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics

from kvstore.policy import make_policy
from kvstore.tiers.allocator import ExtentAllocator
from kvstore.units import format_size, parse_size
from bench.common import emit


def churn(capacity: int, ops: int, min_size: int, max_size: int, seed: int) -> dict:
    rng = random.Random(seed)
    alloc, lru = ExtentAllocator(capacity), make_policy("lru")
    live: dict[int, tuple[int, int]] = {}  # block id -> (offset, size)
    util, frag = [], []
    lo, hi = math.log(min_size), math.log(max_size)
    for block in range(ops):
        size = int(math.exp(rng.uniform(lo, hi)))  # log-uniform: as many 64 KiB as 4 MiB blocks
        while (offset := alloc.alloc(size)) is None:
            off, vsize = live.pop(lru.pop_victim())
            alloc.free(off, vsize)
        live[block] = (offset, size)
        lru.add(block)
        if rng.random() < 0.3 and live:  # re-read a recent block now and then
            lru.touch(rng.randrange(max(0, block - 50), block + 1))
        if block >= ops // 10:  # after warm-up
            util.append(alloc.allocated_bytes / alloc.capacity)
            frag.append(alloc.fragmentation())
    return {
        "capacity": format_size(capacity),
        "ops": ops,
        "sizes": f"{format_size(min_size)}..{format_size(max_size)} log-uniform",
        "mean_utilization": round(statistics.fmean(util), 4),
        "min_utilization": round(min(util), 4),
        "mean_fragmentation": round(statistics.fmean(frag), 4),
        "p99_fragmentation": round(sorted(frag)[int(0.99 * len(frag))], 4),
        "live_blocks_at_end": len(live),
        "free_extents_at_end": alloc.free_extent_count(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capacity", default="8GiB")
    parser.add_argument("--ops", type=int, default=200_000)
    parser.add_argument("--min-size", default="64KiB")
    parser.add_argument("--max-size", default="8MiB")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = churn(parse_size(args.capacity), args.ops, parse_size(args.min_size), parse_size(args.max_size), args.seed)
    emit(result, args.json, lambda r: "\n".join(f"{k}: {v}" for k, v in r.items()))


if __name__ == "__main__":
    main()
