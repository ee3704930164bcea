"""A working set larger than DRAM, read again and again: SSD writes and reads/s with the
SSD copies of promoted blocks kept (inclusive tiers, the default) and dropped.

    python -m bench.tiering --json

One BlockStore per mode (DRAM tier in shared memory, SSD tier in lmdb under a
temporary directory, background eviction on, as a node runs it), filled with
``--blocks`` blocks of ``--size``; then rounds of reads over all of them, in
order (``cyclic``: the worst case for LRU, every read misses DRAM) or in a
random order (``random``). Rounds of the two modes alternate (this machine is
noisy); figures are medians over ``--rounds``. Reported per mode and pattern:
reads/s and SSD bytes written per read (demotions that had to write), and the
ratios of keeping to dropping.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import numpy as np

from bench.common import emit, markdown_table
from kvstore.node.config import StoreConfig
from kvstore.node.store import BlockStore
from kvstore.units import parse_size

MODES = {"keep": True, "drop": False}


def make_store(directory: str, mode: str, dram: int, ssd: int, size: int) -> BlockStore:
    return BlockStore(
        StoreConfig(
            dram_capacity=dram,
            ssd_path=f"{directory}/{mode}",
            ssd_capacity=ssd,
            max_block_bytes=size,
            keep_ssd_copy=MODES[mode],
        )
    )


def fill(store: BlockStore, keys: list, size: int) -> None:
    rng = np.random.default_rng(1)
    for k in keys:
        store.put(k, rng.integers(0, 256, size, dtype=np.uint8))


def read_round(store: BlockStore, order: list, out: bytearray) -> tuple[float, int]:
    """(reads/s, SSD bytes written) of one pass over ``order``; every block must be there."""
    written = store.stats()["ssd"]["bytes_written"]
    start = time.perf_counter()
    for k in order:
        if store.get_into(k, out) is None:
            raise AssertionError(f"block {k!r} lost: the SSD tier is too small for the working set")
    elapsed = time.perf_counter() - start
    return len(order) / elapsed, store.stats()["ssd"]["bytes_written"] - written


def run(blocks: int, size: int, dram: int, ssd: int, rounds: int, patterns: list[str]) -> dict:
    keys = [("tiering", i.to_bytes(16, "little")) for i in range(blocks)]
    out = bytearray(size)
    results: dict = {}
    with tempfile.TemporaryDirectory() as directory:
        stores = {mode: make_store(directory, mode, dram, ssd, size) for mode in MODES}
        try:
            for store in stores.values():
                fill(store, keys, size)
            for pattern in patterns:
                rng = random.Random(7)
                rates = {mode: [] for mode in MODES}
                writes = {mode: [] for mode in MODES}
                for r in range(rounds + 1):  # the first round of each pattern warms up, unmeasured
                    order = list(keys) if pattern == "cyclic" else rng.sample(keys, len(keys))
                    for mode, store in stores.items():
                        rate, wrote = read_round(store, order, out)
                        if r:
                            rates[mode].append(rate)
                            writes[mode].append(wrote / len(order))
                results[pattern] = {
                    mode: {
                        "reads_per_s": round(statistics.median(rates[mode])),
                        "ssd_bytes_written_per_read": round(statistics.median(writes[mode])),
                    }
                    for mode in MODES
                }
                results[pattern]["keep_vs_drop_reads"] = round(
                    statistics.median(a / b for a, b in zip(rates["keep"], rates["drop"])), 3
                )
        finally:
            for store in stores.values():
                store.close()
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--size", default="1MiB")
    parser.add_argument("--dram", default="64MiB")
    parser.add_argument("--ssd", default="512MiB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--patterns", default="cyclic,random")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    size = parse_size(args.size)
    patterns = [p for p in args.patterns.split(",") if p]
    result = {
        "blocks": args.blocks,
        "size": args.size,
        "dram": args.dram,
        "ssd": args.ssd,
        "results": run(args.blocks, size, parse_size(args.dram), parse_size(args.ssd), args.rounds, patterns),
    }
    rows = [
        [
            pattern,
            mode,
            r[mode]["reads_per_s"],
            r[mode]["ssd_bytes_written_per_read"] / size,
            r["keep_vs_drop_reads"] if mode == "keep" else "",
        ]
        for pattern, r in result["results"].items()
        for mode in MODES
    ]
    emit(
        result,
        args.json,
        lambda _: markdown_table(
            ["pattern", "SSD copy on promotion", "reads/s", "SSD writes per read (blocks)", "reads/s keep / drop"], rows
        ),
    )


if __name__ == "__main__":
    main()
