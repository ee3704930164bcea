"""Chained block hashing throughput in tokens per second.

python -m bench.hashing --json
"""

from __future__ import annotations

import argparse
import random

import numpy as np

from kvstore_client.hashing import chain_hashes
from bench.common import emit, median_rate


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--block-sizes", default="16,256,512")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    tokens = [random.Random(0).randrange(128_000) for _ in range(args.tokens)]
    array = np.array(tokens, dtype=np.int64)
    result = {}
    for bs in map(int, args.block_sizes.split(",")):
        result[f"block_{bs}"] = {
            "list_tokens_per_s": round(median_rate(lambda: len(chain_hashes(tokens, bs, "m")) * bs, args.repeats)),
            "numpy_tokens_per_s": round(median_rate(lambda: len(chain_hashes(array, bs, "m")) * bs, args.repeats)),
        }
    emit(result, args.json, lambda r: "\n".join(f"{k}: {v}" for k, v in r.items()))


if __name__ == "__main__":
    main()
