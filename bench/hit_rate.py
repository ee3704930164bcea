"""Prefix hit ratio of a request trace through the real policies and DRAM tier.

    python -m bench.hit_rate --trace conversation_trace.jsonl \
        --policy lru --capacity 10000 --json
    python -m bench.hit_rate --trace FILE --table     # every policy x capacity

Each trace block (one hash_id) becomes one stored block of ``--block-bytes``.
Requests are replayed in timestamp order; for each one the store is asked how
many leading blocks it holds (match_prefix), those blocks are read (get_into,
which is what an engine loading its prefix does, and what the policies see
as accesses), then the request's blocks that are missing are stored, each
with its depth in the chain. Each request is served inside
``BlockStore.request()``: the blocks it reads or writes are not eviction
candidates until it ends (Mooncake, 3.2.1), so a request never evicts its
own blocks; a request longer than the cache stores what fits. The DRAM tier
holds exactly ``--capacity`` blocks, and evicts inline when full so the run
is deterministic.
"""

from __future__ import annotations

import argparse
import time

from kvstore_client.errors import CapacityError
from kvstore.node.config import StoreConfig
from kvstore.node.store import BlockStore
from kvstore.policy import POLICIES
from bench.common import emit, markdown_table
from bench.trace import TraceError, read_trace

CAPACITIES = ["1000", "10000", "50000", "100000", "inf"]


def load_trace(path: str) -> list[dict]:
    """Requests of a JSONL trace in timestamp order (stable for equal stamps); TraceError names the
    file and line of anything wrong (``bench.trace``)."""
    return read_trace(path, ("timestamp", "hash_ids"))


def replay(requests: list[dict], policy: str, capacity: int | None, block_bytes: int = 4096) -> dict:
    """Replay ``requests`` through a BlockStore; ``capacity`` in blocks, None for unbounded."""
    distinct = len({h for r in requests for h in r["hash_ids"]})
    blocks = distinct if capacity is None else capacity
    config = StoreConfig(
        dram_capacity=max(blocks, 1) * block_bytes,
        max_block_bytes=block_bytes,
        policy=policy,
        background_eviction=False,
        high_watermark=1.0,
        low_watermark=1.0,
        granule=block_bytes,
        eviction_batch=1,
    )
    value = bytes(block_bytes)
    buf = bytearray(block_bytes)
    hit = total = 0
    start = time.perf_counter()
    with BlockStore(config) as store:
        for request in requests:
            keys = [("trace", h.to_bytes(16, "little", signed=h < 0)) for h in request["hash_ids"]]
            matched = store.match_prefix(keys)
            with store.request():
                for key in keys[:matched]:
                    store.get_into(key, buf)
                try:
                    for depth in range(matched, len(keys)):
                        if not store.exists(keys[depth]):
                            store.put(keys[depth], value, depth=depth)
                except CapacityError:  # the cache holds only this request's blocks
                    pass
            hit += matched
            total += len(keys)
        stats = store.stats()
    return {
        "policy": policy,
        "capacity_blocks": "inf" if capacity is None else capacity,
        "requests": len(requests),
        "blocks": total,
        "distinct_blocks": distinct,
        "hit_blocks": hit,
        "prefix_hit_ratio": hit / total if total else 0.0,
        "evictions": stats["dram"]["evictions"],
        "seconds": round(time.perf_counter() - start, 2),
    }


def parse_capacity(text: str) -> int | None:
    return None if text == "inf" else int(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", required=True, help="JSONL trace (timestamp, hash_ids per line)")
    parser.add_argument("--policy", choices=sorted(POLICIES), default="lru")
    parser.add_argument("--capacity", default="inf", help="DRAM capacity in blocks, or inf")
    parser.add_argument("--block-bytes", type=int, default=4096, help="bytes stored per trace block")
    parser.add_argument("--table", action="store_true", help="run every policy x capacity and print a table")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    try:
        requests = load_trace(args.trace)
    except TraceError as exc:
        parser.exit(1, f"{parser.prog}: error: {exc}\n")
    if not args.table:
        result = replay(requests, args.policy, parse_capacity(args.capacity), args.block_bytes)
        emit(result, args.json, lambda r: "\n".join(f"{k}: {v}" for k, v in r.items()))
        return
    cells = [replay(requests, p, parse_capacity(c), args.block_bytes) for p in POLICIES for c in CAPACITIES]
    emit({"cells": cells}, args.json, _table)


def _table(result: dict) -> str:
    by = {(c["policy"], str(c["capacity_blocks"])): c for c in result["cells"]}
    rows = [[p] + [f"{by[(p, c)]['prefix_hit_ratio']:.3f}" for c in CAPACITIES] for p in POLICIES]
    return markdown_table(["policy \\ capacity (blocks)"] + CAPACITIES, rows)


if __name__ == "__main__":
    main()
