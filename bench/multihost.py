"""Put and get throughput to a node from its own host and from another host, in network namespaces.

    python -m bench.multihost --json        (root, Linux: bench.netns makes the hosts)

Three simulated hosts on one bridge (``bench.netns``: a network namespace, a veth and a
machine id each): M runs the master, N a storage node, C nothing but a client. The same
node is measured along three paths, by clients that are real processes in their hosts:

- ``same_host_shm``: a client on N, the default path (shared memory: puts copied into the
  node's arena, gets read one-sidedly through its block directory);
- ``same_host_tcp``: a client on N with ``data_path="tcp"`` (TCP to the node's own address,
  which never leaves N's namespace: the protocol's cost without a wire);
- ``cross_host_tcp``: the client on C (TCP through two veths and the bridge).

Each round puts ``--working-set`` bytes of ``--size`` blocks into a fresh namespace
(batch_put, 4 MiB per call) and reads them back (batch_get_into preallocated buffers),
once per path in turn; figures (GB/s) are medians of ``--repeats`` rounds, ratios the
medians of the per-round ratios. The pool runs ``--insecure``: with an access file a
tenant's same-host reads take leases instead (docs/security.md). The master's placement
puts N's client's blocks on N (local first) and C's on N (the only node).

All of it shares this machine's cores and memory: the cross-host figures measure the
kernel's veth and bridge path, not a network card.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from bench.common import emit, markdown_table
from kvstore.units import format_size, parse_size

PATHS = ("same_host_shm", "same_host_tcp", "cross_host_tcp")
BATCH_BYTES = 4 << 20

AGENT = r'''
import os, time
from kvstore_client import Client, make_key

clients = {}
payload = {}

def measure(path, data_path, ns, size, total):
    """(put GB/s, get GB/s) of ``total`` bytes of ``size`` blocks put to and read from the pool."""
    if path not in clients:
        clients[path] = Client(MASTER, data_path=data_path)
    c = clients[path]
    if size not in payload:
        payload[size] = os.urandom(size)
    n = max(1, total // size)
    per_call = max(1, BATCH_BYTES // size)
    keys = [make_key(ns, b"%d" % i) for i in range(n)]
    values = [payload[size]] * per_call
    buffers = [bytearray(size) for _ in range(per_call)]
    start = time.perf_counter()
    for i in range(0, n, per_call):
        batch = keys[i : i + per_call]
        c.batch_put(batch, values[: len(batch)])
    put_s = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(0, n, per_call):
        batch = keys[i : i + per_call]
        got = c.batch_get_into(batch, buffers[: len(batch)])
        if any(g != size for g in got):
            raise RuntimeError(f"{path}: {got.count(None)} of {len(batch)} blocks missing")
    get_s = time.perf_counter() - start
    return n * size / put_s / 1e9, n * size / get_s / 1e9

def transport(path):
    return sorted(type(conn).__name__ for conn in clients[path]._local.conns.values())
'''


def run(sizes: list[int], working_set: int, repeats: int, dram: int) -> dict:
    from bench.netns import Network
    from tests.processes import start_master, start_node

    with tempfile.TemporaryDirectory() as tmp, Network() as net:
        m, n, c = net.add_host("m"), net.add_host("n"), net.add_host("c")
        agents = {"n": n.python(), "c": c.python()}
        services = []
        try:
            master = start_master(ttl=5.0, extra=("--host", m.address, "--insecure"), prefix=tuple(m.command([])))
            services.append(master)
            node = start_node(
                master.record["master"],
                Path(tmp) / "n",
                dram=format_size(dram),
                ssd="0",
                max_block=format_size(max(sizes)),
                extra=("--host", n.address, "--insecure"),
                prefix=tuple(n.command([])),
            )
            services.append(node)
            setup = f"MASTER = {master.record['master']!r}\nBATCH_BYTES = {BATCH_BYTES}\n" + AGENT
            for agent in agents.values():
                agent.exec(setup, timeout=120)
            where = {"same_host_shm": ("n", None), "same_host_tcp": ("n", "tcp"), "cross_host_tcp": ("c", None)}
            result = {"working_set": working_set, "repeats": repeats, "sizes": {}}
            for size in sizes:
                rounds = {p: [] for p in PATHS}
                for r in range(repeats + 1):  # round 0 warms up (connections, arena pages): not counted
                    for path in PATHS:
                        host, data_path = where[path]
                        ns = f"bench-{path}-{size}-{r}"
                        got = agents[host].eval(
                            f"measure({path!r}, {data_path!r}, {ns!r}, {size}, {working_set})", timeout=300
                        )
                        if r:
                            rounds[path].append(got)
                result["sizes"][format_size(size)] = summarize(rounds)
            result["transports"] = {p: agents[where[p][0]].eval(f"transport({p!r})") for p in PATHS}
            return result
        finally:
            for service in reversed(services):
                service.close()


def summarize(rounds: dict) -> dict:
    """Medians per path and op, and the medians of per-round ratios against the same-host paths."""
    out = {}
    for op, k in (("put", 0), ("get", 1)):
        for path in PATHS:
            out[f"{path}_{op}_gbps"] = round(statistics.median(r[k] for r in rounds[path]), 3)
        cross = [r[k] for r in rounds["cross_host_tcp"]]
        for base in ("same_host_shm", "same_host_tcp"):
            ratios = [x / b[k] for x, b in zip(cross, rounds[base])]
            out[f"cross_host_tcp_vs_{base}_{op}"] = round(statistics.median(ratios), 3)
    return out


def table(result: dict) -> str:
    rows = []
    for size, figures in result["sizes"].items():
        for op in ("put", "get"):
            rows.append(
                [
                    size,
                    op,
                    *(figures[f"{p}_{op}_gbps"] for p in PATHS),
                    figures[f"cross_host_tcp_vs_same_host_shm_{op}"],
                    figures[f"cross_host_tcp_vs_same_host_tcp_{op}"],
                ]
            )
    return markdown_table(
        [
            "block",
            "op",
            "same host shm GB/s",
            "same host tcp GB/s",
            "cross host tcp GB/s",
            "cross / shm",
            "cross / same-host tcp",
        ],
        rows,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64KiB,1MiB", help="block sizes, comma-separated")
    parser.add_argument("--working-set", default="32MiB", help="bytes put and read per path per round")
    parser.add_argument("--repeats", type=int, default=5, help="rounds counted (after one warm-up round)")
    parser.add_argument("--dram", default="256MiB", help="the node's DRAM tier (old rounds are evicted)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    from bench.netns import unavailable

    reason = unavailable()
    if reason:
        sys.exit(f"bench.multihost: {reason}")
    result = run(
        [parse_size(s) for s in args.sizes.split(",")],
        parse_size(args.working_set),
        args.repeats,
        parse_size(args.dram),
    )
    emit(result, args.json, table)


if __name__ == "__main__":
    main()
