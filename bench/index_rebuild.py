"""The master's index after kill -9 and restart: how fast the nodes' inventories bring it back.

    python -m bench.index_rebuild [--blocks 1000000] [--nodes 4] [--runs 3] [--json]

A master (``--ttl``, the nodes' lease) and ``--nodes`` storage nodes as processes on
127.0.0.1; one client writes ``--blocks`` small blocks (``--value-bytes`` each, batches of
1,000) spread over the nodes, and waits until the index holds them all. Then, ``--runs``
times: kill -9 of the master, restart on the same port, and ClusterStatus polled every
20 ms from the restart's exec: the curve of indexed keys against time. Each node finds
the new master when its channel reconnects (it redials every 0.25 s), registers and
resends its whole inventory packed (kvstore.node.master_agent), which the master indexes
as it arrives. Reported per run: seconds from exec to serving, to every node registered,
to the first and to the last node's blocks, and to 100%; and the curve (time to 10%,
25%, ..., 100%). A sample of keys is located after each run: every one must be found
(``missing`` must be 0).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from bench.cluster import Service, reap_arenas, start_node
from bench.common import emit, markdown_table, wait_until

NAMESPACE = "rebuild"
FRACTIONS = (0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_master(workdir: Path, port: int, ttl: float, run: int) -> Service:
    return Service(
        ["master", "--port", str(port), "--metrics-port", "-1", "--ttl", str(ttl)], workdir / f"master-{run}.err"
    )


def load(master: str, blocks: int, value_bytes: int) -> list[bytes]:
    """Write ``blocks`` blocks of ``value_bytes``; their digests."""
    from kvstore_client import Client

    rng = random.Random(1)
    digests = [rng.randbytes(16) for _ in range(blocks)]
    value = bytes(value_bytes)
    with Client(master) as client:
        for start in range(0, blocks, 1000):
            chunk = digests[start : start + 1000]
            client.batch_put([(NAMESPACE, d) for d in chunk], [value] * len(chunk))
    return digests


def status(stub) -> tuple[int, int, int] | None:
    """(indexed keys, nodes with blocks indexed, nodes registered), or None while the master does not answer."""
    from kvstore_client.proto import kvstore_pb2 as pb

    try:
        reply = stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=2)
    except grpc.RpcError:
        return None
    return reply.indexed_keys, sum(1 for n in reply.nodes if n.indexed_blocks), len(reply.nodes)


def missing(master: str, digests: list[bytes], sample: int = 20_000) -> int:
    from kvstore_client.proto import kvstore_pb2 as pb
    from kvstore_client.proto import kvstore_pb2_grpc as pb_grpc

    picked = random.Random(2).sample(digests, min(sample, len(digests)))
    with grpc.insecure_channel(master) as channel:
        stub = pb_grpc.MasterStub(channel)
        gone = 0
        for start in range(0, len(picked), 5000):
            reply = stub.Locate(pb.KeyBatch(namespace=NAMESPACE, digests=picked[start : start + 5000]), timeout=30)
            gone += sum(1 for location in reply.locations if not location.replicas)
    return gone


def one_restart(workdir: Path, port: int, ttl: float, run: int, total: int, nodes: int, old: Service) -> tuple:
    from kvstore_client.proto import kvstore_pb2_grpc as pb_grpc

    old.proc.send_signal(signal.SIGKILL)
    old.proc.wait()
    started = time.monotonic()
    master = start_master(workdir, port, ttl, run)
    serving = time.monotonic() - started  # it printed its address: listening
    curve, first_node, all_nodes, registered = [], None, None, None
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.MasterStub(channel)
        deadline = started + 120
        while time.monotonic() < deadline:
            seen = status(stub)
            now = time.monotonic() - started
            if seen is not None:
                keys, with_blocks, known = seen
                curve.append((round(now, 3), keys))
                if known == nodes and registered is None:
                    registered = now
                if with_blocks and first_node is None:
                    first_node = now
                if with_blocks == nodes and all_nodes is None:
                    all_nodes = now
                if keys >= total:
                    break
            time.sleep(0.02)
    complete = curve[-1][0] if curve and curve[-1][1] >= total else None
    reached = {f: next((t for t, k in curve if k >= f * total), None) for f in FRACTIONS}
    return master, {
        "serving_s": round(serving, 3),
        "registered_s": registered and round(registered, 3),
        "first_node_s": first_node and round(first_node, 3),
        "all_nodes_s": all_nodes and round(all_nodes, 3),
        "complete_s": complete,
        "reached_s": {str(f): t for f, t in reached.items()},
        "curve": curve,
    }


def run(blocks: int, nodes: int, runs: int, ttl: float, value_bytes: int, workdir: Path) -> dict:
    port = free_port()
    master = start_master(workdir, port, ttl, 0)
    address = f"127.0.0.1:{port}"
    # Small blocks sit in whole allocator pages; size DRAM for them (4 KiB each) plus slack.
    dram = f"{max(64, (blocks // nodes) * 4096 // (1 << 20) * 5 // 4)}MiB"
    started = [
        start_node(address, workdir, f"node{i}", dram=dram, ssd="64MiB", max_block="64KiB") for i in range(nodes)
    ]
    try:
        t0 = time.monotonic()
        digests = load(address, blocks, value_bytes)
        load_s = time.monotonic() - t0
        from kvstore_client.proto import kvstore_pb2_grpc as pb_grpc

        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.MasterStub(channel)
            wait_until(lambda: (status(stub) or (0, 0, 0))[0] >= blocks, timeout=120, interval=0.1)
        results = []
        for i in range(1, runs + 1):
            master, result = one_restart(workdir, port, ttl, i, blocks, nodes, master)
            result["missing"] = missing(address, digests)
            results.append(result)
        return summarize(blocks, nodes, ttl, value_bytes, load_s, results)
    finally:
        master.close()
        for node in started:
            node.close()
        reap_arenas()


def summarize(blocks, nodes, ttl, value_bytes, load_s, results) -> dict:
    def median(field):
        values = [r[field] for r in results if r[field] is not None]
        return round(statistics.median(values), 3) if values else None

    return {
        "blocks": blocks,
        "nodes": nodes,
        "master_ttl_s": ttl,
        "value_bytes": value_bytes,
        "load_s": round(load_s, 1),
        "runs": results,
        "median": {f: median(f) for f in ("serving_s", "registered_s", "first_node_s", "all_nodes_s", "complete_s")},
        "missing": sum(r["missing"] for r in results),
        "nproc": os.cpu_count(),
    }


def table(r: dict) -> str:
    rows = [
        [
            i + 1,
            x["serving_s"],
            x["registered_s"],
            x["first_node_s"],
            x["all_nodes_s"],
            x["complete_s"],
            " ".join(f"{float(f):.0%}:{t}" for f, t in x["reached_s"].items()),
            x["missing"],
        ]
        for i, x in enumerate(r["runs"])
    ]
    head = (
        f"{r['blocks']:,} blocks on {r['nodes']} nodes (node lease {r['master_ttl_s']} s), "
        f"loaded in {r['load_s']} s; seconds from the restart's exec\n\n"
    )
    return head + markdown_table(
        ["run", "serving", "all registered", "first node's blocks", "all nodes' blocks", "100%", "curve", "missing"],
        rows,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--ttl", type=float, default=3.0, help="the master's node lease (--ttl)")
    parser.add_argument("--value-bytes", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.blocks < 1 or args.nodes < 1 or args.runs < 1:
        parser.error("--blocks, --nodes and --runs must be at least 1")
    with tempfile.TemporaryDirectory(prefix="kvstore-rebuild-") as tmp:
        result = run(args.blocks, args.nodes, args.runs, args.ttl, args.value_bytes, Path(tmp))
    emit({k: v for k, v in result.items()} if args.json else result, args.json, table)
    return 0 if result["missing"] == 0 and all(r["complete_s"] is not None for r in result["runs"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
