"""How long Python's garbage collector stops a node that keeps replacing blocks, with and
without ``kvstore.gc_pauses.install()`` (what ``kvstore node``, ``master`` and ``up`` run).

    python -m bench.gc_pauses --json

Each mode runs in a fresh interpreter: an empty BlockStore filled with
``--blocks`` small blocks (``fill``: the store grows, as a node does after it
starts), then ``--puts`` puts of new keys that each evict one old block
(``churn``: a full cache under steady load). Timed: every put, and every full
(generation 2) collection through ``gc.callbacks``. Reported per phase and
mode: how many full collections, the longest and all of them together, the
longest put and the 99.9th percentile put (ms); the modes alternate over
``--runs`` runs and figures are medians.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time

from bench.common import emit, markdown_table

VALUE = b"v" * 100
GRANULE = 4096


def measure(mode: str, blocks: int, puts: int) -> dict:
    """One run in this interpreter (call it in a fresh one): fill an empty store with ``blocks``
    blocks, then ``puts`` more, each evicting one, and time every put and full collection."""
    from kvstore.gc_pauses import install
    from kvstore.node.config import StoreConfig
    from kvstore.node.store import BlockStore

    store = BlockStore(
        StoreConfig(
            dram_capacity=blocks * GRANULE,
            max_block_bytes=GRANULE,
            policy="lru",
            background_eviction=False,
            high_watermark=1.0,
            low_watermark=1.0,
            directory_slots=0,
        )
    )
    if mode == "frozen":
        install()
    phases = {"fill": (0, blocks), "churn": (blocks, blocks + puts)}
    pauses: list[float] = []
    started: list[float] = []

    def timer(phase: str, info: dict) -> None:
        if info.get("generation") == 2:
            if phase == "start":
                started.append(time.perf_counter())
            elif started:
                pauses.append(time.perf_counter() - started.pop())

    gc.callbacks.insert(0, timer)
    clock, result = time.perf_counter, {}
    for name, (first, end) in phases.items():
        pauses.clear()
        latencies = []
        for i in range(first, end):
            start = clock()
            store.put(("gc", i.to_bytes(16, "little")), VALUE)
            latencies.append(clock() - start)
        latencies.sort()
        result[name] = {
            "full_collections": len(pauses),
            "longest_collection_ms": round(1e3 * max(pauses, default=0.0), 2),
            "total_collection_ms": round(1e3 * sum(pauses), 2),
            "longest_put_ms": round(1e3 * latencies[-1], 3),
            "p999_put_ms": round(1e3 * latencies[int(0.999 * (len(latencies) - 1))], 3),
        }
    gc.callbacks.remove(timer)
    assert len(store) <= blocks
    store.close()
    return result


def run_fresh(mode: str, blocks: int, puts: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "bench.gc_pauses", "--worker", mode, "--blocks", str(blocks), "--puts", str(puts)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=500_000)
    parser.add_argument("--puts", type=int, default=500_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--worker", choices=["default", "frozen"], help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(measure(args.worker, args.blocks, args.puts)))
        return
    runs: dict[str, list[dict]] = {"default": [], "frozen": []}
    for _ in range(args.runs):
        for mode in runs:
            runs[mode].append(run_fresh(mode, args.blocks, args.puts))
    result = {
        "blocks": args.blocks,
        "puts": args.puts,
        "runs": args.runs,
        "modes": {
            mode: {phase: {k: statistics.median(r[phase][k] for r in rs) for k in rs[0][phase]} for phase in rs[0]}
            for mode, rs in runs.items()
        },
    }
    keys = ("full_collections", "longest_collection_ms", "total_collection_ms", "longest_put_ms", "p999_put_ms")
    header = ["phase", "mode", "full collections", "longest (ms)", "all (ms)", "longest put (ms)", "p99.9 put (ms)"]
    rows = [
        [phase, mode, *(m[phase][k] for k in keys)]
        for phase in ("fill", "churn")
        for mode, m in result["modes"].items()
    ]
    emit(result, args.json, lambda _: markdown_table(header, rows))


if __name__ == "__main__":
    main()
