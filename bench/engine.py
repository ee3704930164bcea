"""In-process put and get_into throughput of the block store, next to memcpy.

    python -m bench.engine --json

For each value size the store's DRAM tier (prefaulted shared memory) holds a
working set of ``--working-set`` bytes of blocks; put writes every block of
the set from one source buffer (replacing the previous version, so the
allocator churns as in steady state), get_into reads every block into one
destination buffer. The memcpy baseline does the same copies with
numpy.copyto between the same hot buffer and a cold buffer set of the same
size, in the same run. Figures are medians of ``--repeats`` rounds.
"""

from __future__ import annotations

import argparse

import numpy as np

from kvstore.node.config import StoreConfig
from kvstore.node.store import BlockStore
from kvstore.units import parse_size
from bench.common import emit, markdown_table, median_rate

SIZES = ["64KiB", "1MiB", "4MiB"]


def bench_size(size: int, working_set: int, repeats: int) -> dict:
    count = max(working_set // size, 8)
    src = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    dst = np.empty(size, dtype=np.uint8)
    cold = np.empty((count, size), dtype=np.uint8)
    cold[:] = src  # touch every page before timing

    def memcpy_round() -> int:
        for i in range(count):
            np.copyto(dst, cold[i])
        return count * size

    config = StoreConfig(
        dram_capacity=2 * count * size + (64 << 20), max_block_bytes=size, prefault=True, background_eviction=False
    )
    keys = [("bench", i.to_bytes(16, "little")) for i in range(count)]
    with BlockStore(config) as store:

        def put_round() -> int:
            for key in keys:
                store.put(key, src)
            return count * size

        def get_round() -> int:
            for key in keys:
                store.get_into(key, dst)
            return count * size

        put_round()  # first versions in place: every later round replaces
        memcpy = median_rate(memcpy_round, repeats)
        put = median_rate(put_round, repeats)
        get = median_rate(get_round, repeats)
        assert bytes(store.get(keys[-1])) == src.tobytes()
    return {
        "blocks": count,
        "put_gbps": round(put / 1e9, 3),
        "get_gbps": round(get / 1e9, 3),
        "memcpy_gbps": round(memcpy / 1e9, 3),
        "put_vs_memcpy": round(put / memcpy, 3),
        "get_vs_memcpy": round(get / memcpy, 3),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=",".join(SIZES), help="comma-separated value sizes")
    parser.add_argument("--working-set", default="256MiB", help="bytes of blocks per size")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    working_set = parse_size(args.working_set)
    result = {s: bench_size(parse_size(s), working_set, args.repeats) for s in args.sizes.split(",")}
    emit(result, args.json, _table)


def _table(result: dict) -> str:
    rows = [
        [s, r["put_gbps"], r["get_gbps"], r["memcpy_gbps"], r["put_vs_memcpy"], r["get_vs_memcpy"]]
        for s, r in result.items()
    ]
    return markdown_table(["size", "put GB/s", "get_into GB/s", "memcpy GB/s", "put/memcpy", "get/memcpy"], rows)


if __name__ == "__main__":
    main()
