"""Throughput of a kvstore pool through the SDK: put, get_into and their batch forms.

Against a pool given by ``master`` or, by default, an embedded one (master and
one node in this process, DRAM only) started for the run. Latency figures
are per call (a batch call counts once).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from contextlib import contextmanager

import numpy as np

from kvstore_client.client import Client

OPS = ("put", "get_into", "batch_put", "batch_get_into")


@contextmanager
def embedded_pool(dram: int):
    """A master and one storage node in this process, on free loopback ports."""
    from kvstore.master.server import MasterServer
    from kvstore.node.config import StoreConfig
    from kvstore.node.daemon import NodeOptions, StorageNode

    master = MasterServer(host="127.0.0.1", port=0, ttl_s=5.0, heartbeat_interval_s=0.5).start()
    with tempfile.TemporaryDirectory() as tmp:
        node = StorageNode(StoreConfig(dram_capacity=dram, max_block_bytes=min(dram, 64 << 20)),
                           NodeOptions(master=master.address, port=0, data_dir=tmp)).start()
        try:
            deadline = time.monotonic() + 10
            while not node.agent.registered and time.monotonic() < deadline:
                time.sleep(0.02)
            yield master.address
        finally:
            node.stop()
            master.stop()


def run_op(client: Client, op: str, size: int, count: int, batch: int) -> dict:
    """Time one operation over ``count`` blocks of ``size`` bytes."""
    keys = [("bench", i.to_bytes(16, "little")) for i in range(count)]
    value = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    out = [np.empty(size, dtype=np.uint8) for _ in range(batch)]
    if op.startswith("get"):
        for start in range(0, count, batch):
            client.batch_put(keys[start : start + batch], [value] * len(keys[start : start + batch]))
    latencies = []
    begin = time.perf_counter()
    step = batch if op.startswith("batch") else 1
    for start in range(0, count, step):
        chunk = keys[start : start + step]
        t0 = time.perf_counter()
        if op == "put":
            client.put(chunk[0], value)
        elif op == "batch_put":
            client.batch_put(chunk, [value] * len(chunk))
        elif op == "get_into":
            if client.get_into(chunk[0], out[0]) is None:
                raise RuntimeError("benchmark block missing: the pool is too small for --count x --size")
        else:
            if None in client.batch_get_into(chunk, out[: len(chunk)]):
                raise RuntimeError("benchmark block missing: the pool is too small for --count x --size")
        latencies.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - begin
    latencies.sort()
    return {
        "op": op, "size": size, "blocks": count,
        "gbps": round(count * size / elapsed / 1e9, 3),
        "ops_per_s": round(count / elapsed, 1),
        "p50_ms": round(1e3 * statistics.median(latencies), 3),
        "p99_ms": round(1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 3),
    }


def run(master: str | None, sizes: list[int], ops: list[str], count_bytes: int, batch: int,
        transport: str, dram: int) -> list[dict]:
    """Every op at every size; a fresh key range per size."""
    def measure(address: str) -> list[dict]:
        results = []
        with Client(address, prefer_shm=transport == "shm") as client:
            for size in sizes:
                count = max(count_bytes // size, batch)
                for op in ops:
                    results.append({**run_op(client, op, size, count, batch), "transport": transport})
        return results

    if master:
        return measure(master)
    with embedded_pool(dram) as address:
        return measure(address)
