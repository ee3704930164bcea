"""Master index lookups through gRPC: Locate and MatchPrefix keys/s at 1M+ blocks.

``python -m bench.master_index [--chains 1000] [--chain-len 1000] [--rounds 5] [--json]``

A MasterServer on 127.0.0.1 with 4 simulated nodes, loaded in-process (no
gRPC) with ``chains`` prefix chains of ``chain-len`` random 16-byte digests:
chain c lives whole on node c % 4 (its last quarter in SSD) and its first
half is replicated on node (c + 1) % 4, so 1,000 x 1,000 gives 1M distinct
keys and 1.5M (node, key) entries. Then one client, one channel, a real
stub, batches of ``batch`` keys, sequential calls:

- locate_chain: Locate of one whole chain per call.
- locate_mixed: Locate of keys drawn at random from every chain, 10% unknown.
- match_prefix: MatchPrefix of one whole chain per call (walks all of it).
- *_inproc: the same index calls without gRPC, for the adapter's share.

Each figure is the median over ``rounds`` rounds of ``calls`` calls.
Target: >= 100,000 keys/s for Locate and MatchPrefix through gRPC.
"""

from __future__ import annotations

import argparse
import gc
import random
import time

import grpc

from bench.common import emit, markdown_table, median_rate
from kvstore.master.index import DRAM, SSD, STORED
from kvstore.master.membership import NodeIdentity
from kvstore.master.server import MasterServer
from kvstore_client.proto import kvstore_pb2 as pb
from kvstore_client.proto import kvstore_pb2_grpc as pb_grpc

NAMESPACE = "bench/llama3-70b"
NODES = 4
TARGET = 100_000


def load(server: MasterServer, chains: int, chain_len: int, seed: int) -> list[list[bytes]]:
    """Register NODES nodes and index the chains in-process; return the chains."""
    rng = random.Random(seed)
    node_ids = [f"node-{i}" for i in range(NODES)]
    for i, node_id in enumerate(node_ids):
        server.membership.register(NodeIdentity(node_id, host=f"h{i}", machine_id=f"m{i}", data_address=f"h{i}:7000"))
    all_chains = [[rng.randbytes(16) for _ in range(chain_len)] for _ in range(chains)]
    ssd_from, half = chain_len * 3 // 4, chain_len // 2
    for c, chain in enumerate(all_chains):
        whole = [(STORED, SSD if i >= ssd_from else DRAM, d) for i, d in enumerate(chain)]
        server.index.apply(node_ids[c % NODES], [(NAMESPACE, whole)])
        server.index.apply(node_ids[(c + 1) % NODES], [(NAMESPACE, [(STORED, DRAM, d) for d in chain[:half]])])
    return all_chains


def make_batches(chains: list[list[bytes]], batch: int, calls: int, seed: int) -> dict[str, list[list[bytes]]]:
    rng = random.Random(seed + 1)
    chain_batches = [rng.choice(chains)[:batch] for _ in range(calls)]
    mixed = []
    for _ in range(calls):
        keys = [rng.choice(rng.choice(chains)) for _ in range(batch)]
        for i in rng.sample(range(batch), batch // 10):
            keys[i] = rng.randbytes(16)
        mixed.append(keys)
    return {"chain": chain_batches, "mixed": mixed}


def measure(stub, server: MasterServer, batches: dict, rounds: int) -> dict[str, float]:
    """Median keys/s per operation."""
    req = {name: [pb.KeyBatch(namespace=NAMESPACE, digests=b) for b in bs] for name, bs in batches.items()}
    index = server.index

    def run(call, requests):
        def once() -> int:
            n = 0
            for r in requests:
                call(r)
                n += len(r.digests)
            return n

        return once

    def run_inproc(fn, key_batches):
        def once() -> int:
            for b in key_batches:
                fn(NAMESPACE, b)
            return sum(map(len, key_batches))

        return once

    for r in req["chain"][:20]:  # warm up the channel, caches and thread pool
        stub.Locate(r)
        stub.MatchPrefix(r)
    checks = stub.MatchPrefix(req["chain"][0])
    assert checks.longest == len(batches["chain"][0]), checks
    return {
        "locate_chain": median_rate(run(stub.Locate, req["chain"]), rounds),
        "locate_mixed": median_rate(run(stub.Locate, req["mixed"]), rounds),
        "match_prefix": median_rate(run(stub.MatchPrefix, req["chain"]), rounds),
        "locate_chain_inproc": median_rate(run_inproc(index.locate, batches["chain"]), rounds),
        "locate_mixed_inproc": median_rate(run_inproc(index.locate, batches["mixed"]), rounds),
        "match_prefix_inproc": median_rate(run_inproc(index.match_prefix, batches["chain"]), rounds),
    }


def run_bench(chains: int, chain_len: int, batch: int, calls: int, rounds: int, seed: int) -> dict:
    server = MasterServer(port=0, ttl_s=3600.0, heartbeat_interval_s=60.0).start()
    try:
        t0 = time.perf_counter()
        all_chains = load(server, chains, chain_len, seed)
        load_s = time.perf_counter() - t0
        gc.collect()
        batches = make_batches(all_chains, batch, calls, seed)
        with grpc.insecure_channel(server.address) as channel:
            rates = measure(pb_grpc.MasterStub(channel), server, batches, rounds)
        return {
            "indexed_keys": server.index.size(),
            "entries": sum(sum(c.values()) for c in server.index.node_counts().values()),
            "nodes": NODES,
            "batch": batch,
            "calls_per_round": calls,
            "rounds": rounds,
            "load_s": round(load_s, 2),
            "keys_per_s": {k: round(v) for k, v in rates.items()},
            "target_keys_per_s": TARGET,
            "meets_target": all(rates[k] >= TARGET for k in ("locate_chain", "locate_mixed", "match_prefix")),
        }
    finally:
        server.stop(0)


def format_table(result: dict) -> str:
    rows = [[name, f"{rate:,}"] for name, rate in result["keys_per_s"].items()]
    head = (
        f"master index: {result['indexed_keys']:,} keys ({result['entries']:,} node entries) on "
        f"{result['nodes']} nodes, batches of {result['batch']}, target {TARGET:,} keys/s"
    )
    return head + "\n" + markdown_table(["operation", "keys/s (median)"], rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.master_index", description=__doc__.splitlines()[0])
    parser.add_argument("--chains", type=int, default=1000, help="prefix chains (default 1000)")
    parser.add_argument("--chain-len", type=int, default=1000, help="blocks per chain (default 1000)")
    parser.add_argument("--batch", type=int, default=1000, help="keys per call (default 1000)")
    parser.add_argument("--calls", type=int, default=200, help="calls per round (default 200)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; the median is reported (default 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    result = run_bench(args.chains, args.chain_len, args.batch, args.calls, args.rounds, args.seed)
    emit(result, args.json, format_table)


if __name__ == "__main__":
    main()
