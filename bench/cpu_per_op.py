"""CPU per get: where the time of several clients reading over TCP goes, kvstore against a raw socket.

    python -m bench.cpu_per_op --clients 4 --json

When clients and the node share few cores, throughput is CPU per operation.
This runs ``--clients`` client processes that read ``--size`` blocks over TCP
for ``--seconds``, first from a storage node (``bench.node_process``:
TcpConnection.get_into, checksum verified), then from the raw-socket baseline
server of ``kvstore bench`` (one thread per connection, a 16-byte request
answered with the block), ``--repeats`` times alternated. Each run reports
aggregate GB/s and, per operation, the server process's user and system CPU
(from /proc, Linux only) and the clients' CPU (their own process time); figures
are medians over repeats, the ratio is the median of per-repeat ratios.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

import numpy as np

from bench.common import emit, markdown_table
from bench.node_process import NodeProcess, bench_keys
from kvstore.benchmark.baselines import SOCKET_REQUEST, serve_socket, socket_client, socket_get
from kvstore.benchmark.pool import HelperProcess
from kvstore.units import parse_size

_TICK = os.sysconf("SC_CLK_TCK")


def process_cpu(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of process ``pid`` so far, threads included."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / _TICK, int(fields[12]) / _TICK


def _kvstore_reader(address: str, size: int, count: int):
    from kvstore_client.transport import TcpConnection

    conn, keys, dst = TcpConnection(address), bench_keys(count), np.empty(size, np.uint8)
    return lambda i: conn.get_into(keys[i % count], dst)


def _raw_reader(address: str, size: int, count: int):
    sock, view, request = socket_client(address), memoryview(np.empty(size, np.uint8)), SOCKET_REQUEST.pack(0, size)
    return lambda _: socket_get(sock, view, request)


READERS = {"kvstore": _kvstore_reader, "raw": _raw_reader}


def _client(kind: str, address: str, size: int, count: int, seconds: float, barrier, results) -> None:
    """One client process: warm up, wait for the others, read for ``seconds``; report (ops, CPU s)."""
    read = READERS[kind](address, size, count)
    for i in range(count):
        read(i)
    barrier.wait()
    start, cpu, ops = time.perf_counter(), time.process_time(), 0
    while time.perf_counter() - start < seconds:
        for i in range(count):
            read(i)
        ops += count
    results.put((ops, time.process_time() - cpu))


def measure(kind: str, address: str, server_pid: int, clients: int, size: int, count: int, seconds: float) -> dict:
    """One run of ``clients`` processes reading from one server: GB/s and CPU microseconds per get."""
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(clients + 1), ctx.Queue()
    procs = [
        ctx.Process(target=_client, args=(kind, address, size, count, seconds, barrier, results))
        for _ in range(clients)
    ]
    for p in procs:
        p.start()
    barrier.wait()
    user0, sys0 = process_cpu(server_pid)
    start = time.perf_counter()
    done = [results.get() for _ in procs]
    elapsed = time.perf_counter() - start
    user1, sys1 = process_cpu(server_pid)
    for p in procs:
        p.join()
    ops = sum(n for n, _ in done)
    per_op = 1e6 / ops
    return {
        "gbps": ops * size / elapsed / 1e9,
        "server_user_us": (user1 - user0) * per_op,
        "server_system_us": (sys1 - sys0) * per_op,
        "clients_us": sum(c for _, c in done) * per_op,
    }


def run(clients: int, size: int, count: int, seconds: float, repeats: int, unix_path: str) -> dict:
    raw = HelperProcess(mp.get_context("spawn"), serve_socket, [size], [count])
    try:
        with NodeProcess(size, count, unix_path) as node:
            servers = {"kvstore": (node.info["address"], node.proc.pid), "raw": (raw.info, raw.proc.pid)}
            runs = {kind: [] for kind in servers}
            for _ in range(repeats):
                for kind, (address, pid) in servers.items():
                    runs[kind].append(measure(kind, address, pid, clients, size, count, seconds))
    finally:
        raw.close()
    result = {kind: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for kind, rs in runs.items()}
    result["kvstore_vs_raw"] = statistics.median(k["gbps"] / r["gbps"] for k, r in zip(runs["kvstore"], runs["raw"]))
    result["runs"] = runs
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--size", default="1MiB")
    parser.add_argument("--count", type=int, default=64, help="blocks each client reads in turn")
    parser.add_argument("--seconds", type=float, default=3.0, help="per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--unix", default="/tmp/kvstore-bench-cpu.sock", help="the node's Unix socket")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = run(args.clients, parse_size(args.size), args.count, args.seconds, args.repeats, args.unix)
    result.update(clients=args.clients, size=args.size)
    emit(result, args.json, _table)


def _table(result: dict) -> str:
    rows = [
        [kind, round(r["gbps"], 2), round(r["server_user_us"]), round(r["server_system_us"]), round(r["clients_us"])]
        for kind, r in ((k, result[k]) for k in ("kvstore", "raw"))
    ]
    head = ["server", "GB/s", "server user µs/get", "server system µs/get", "clients µs/get"]
    return (
        f"{result['clients']} clients, {result['size']} gets over TCP (medians)\n\n"
        + markdown_table(head, rows)
        + f"\n\nkvstore / raw socket: {result['kvstore_vs_raw']:.2f}"
    )


if __name__ == "__main__":
    main()
