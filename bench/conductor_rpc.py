"""What one conductor call costs: Schedule over gRPC against the master's conductor port.

    python -m bench.conductor_rpc [--calls 300] [--runs 5] [--json]

A real master process (``kvstore master``, loopback, ports chosen at run time) with a prefill
and a decode engine registered; this process calls ``Schedule`` (then reports the request
cancelled, off the clock) ``--calls`` times each way: over gRPC (the SDK's
``client.scheduling.schedule``, from a thread as the router would) and over the conductor port
(``ConductorLink`` in an asyncio loop), back to back and with ``--gap-ms`` of idle between
calls (a router between requests: the processes' threads go to sleep, and each call wakes
them). The baseline, measured in the same run: a plain TCP round trip of a 64-byte message to a
thread of another process, the least any call to the master can cost. Reported: the median
microseconds of a call, per way and pacing, medians over ``--runs`` runs, and each as a ratio to
the baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time

from bench.common import emit, markdown_table
from bench.serve_procs import kvstore_service

NS = "bench/conductor"
ECHO_SERVER = """
import socket, sys, threading
ls = socket.create_server(("127.0.0.1", 0)); print(ls.getsockname()[1], flush=True)
def serve(c):
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while (data := c.recv(64)):
        c.sendall(data)
while True:
    c, _ = ls.accept(); threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


def _keys(n: int = 4) -> list:
    return [(NS, os.urandom(32)) for _ in range(n)]


def _median_us(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e6, 1)


def time_grpc(client, calls: int, gap: float) -> float:
    async def run() -> list[float]:
        out = []
        for i in range(calls):
            rid = f"g{i}-{time.monotonic_ns()}"
            start = time.perf_counter()
            await asyncio.to_thread(client.scheduling.schedule, _keys(), 128, 4, rid, NS, True)
            out.append(time.perf_counter() - start)
            client.scheduling.report_request(NS, rid, "cancelled")
            if gap:
                await asyncio.sleep(gap)
        return out

    return _median_us(asyncio.run(run()))


def time_port(address: str, calls: int, gap: float) -> float:
    from kvstore_client.conductor_link import ConductorLink

    async def run() -> list[float]:
        link = ConductorLink(address)
        out = []
        try:
            await link.connect()
            for i in range(calls):
                rid = f"p{i}-{time.monotonic_ns()}"
                start = time.perf_counter()
                await link.schedule(_keys(), 128, 4, rid, NS, True)
                out.append(time.perf_counter() - start)
                await link.report_request(NS, rid, "cancelled")
                if gap:
                    await asyncio.sleep(gap)
        finally:
            await link.close()
        return out

    return _median_us(asyncio.run(run()))


def time_socket(port: int, calls: int, gap: float) -> float:
    out = []
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(calls):
            start = time.perf_counter()
            sock.sendall(b"x" * 64)
            got = 0
            while got < 64:
                got += len(sock.recv(64 - got))
            out.append(time.perf_counter() - start)
            if gap:
                time.sleep(gap)
    return _median_us(out)


def join_placeholder_node(master: str, node_id: str) -> None:
    """Register ``node_id`` with the master, as a node would: the conductor takes engines only on
    live nodes. No node process runs (the calls timed here move no blocks); it stays registered
    for the master's --ttl, and engines on it stay after that."""
    import grpc

    from kvstore_client.proto import kvstore_pb2 as pb
    from kvstore_client.proto import kvstore_pb2_grpc as pb_grpc

    with grpc.insecure_channel(master) as channel:
        pb_grpc.MasterStub(channel).Register(pb.RegisterRequest(info=pb.NodeInfo(node_id=node_id)), timeout=10)


def run(calls: int, runs: int, gap_ms: float, workdir: str) -> dict:
    from kvstore_client import Client

    master, record = kvstore_service(
        "master", ["master", "--port", "0", "--metrics-port", "-1"], os.path.join(workdir, "master.log")
    )
    echo = subprocess.Popen([sys.executable, "-c", ECHO_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        echo_port = int(echo.stdout.readline())
        with Client(record["master"]) as client:
            join_placeholder_node(record["master"], "node-1")
            client.scheduling.register_engine(NS, "P", "prefill", "node-1")
            client.scheduling.register_engine(NS, "D", "decode", "node-1")
            paced: dict = {}
            for pacing, gap in (("back to back", 0.0), (f"{gap_ms:g} ms apart", gap_ms / 1000)):
                samples: dict = {"socket": [], "grpc": [], "port": []}
                for _ in range(runs):
                    samples["socket"].append(time_socket(echo_port, calls, gap))
                    samples["grpc"].append(time_grpc(client, calls, gap))
                    samples["port"].append(time_port(record["conductor"], calls, gap))
                medians = {way: statistics.median(values) for way, values in samples.items()}
                paced[pacing] = {
                    "median_us": medians,
                    "runs_us": samples,
                    "vs_socket": {way: round(medians[way] / medians["socket"], 1) for way in ("grpc", "port")},
                    "grpc_over_port": round(medians["grpc"] / medians["port"], 1),
                }
    finally:
        echo.kill()
        echo.wait()
        master.stop()
    return {"calls": calls, "runs": runs, "gap_ms": gap_ms, "nproc": os.cpu_count(), "pacing": paced}


def table(result: dict) -> str:
    rows = []
    for pacing, r in result["pacing"].items():
        m = r["median_us"]
        rows.append([pacing, m["socket"], m["grpc"], m["port"], r["grpc_over_port"]])
    return markdown_table(
        [
            "calls",
            "TCP round trip (us)",
            "Schedule over gRPC (us)",
            "Schedule over the conductor port (us)",
            "gRPC / port",
        ],
        rows,
    )


def main(argv: list[str] | None = None) -> None:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300, help="calls per way, pacing and run")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--gap-ms", type=float, default=20.0, help="idle between paced calls")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.runs < 1 or args.gap_ms < 0:
        parser.error("--calls and --runs must be >= 1, --gap-ms >= 0")
    with tempfile.TemporaryDirectory(prefix="bench-conductor-rpc-") as workdir:
        result = run(args.calls, args.runs, args.gap_ms, workdir)
    result["command"] = "python -m bench.conductor_rpc " + " ".join(argv if argv is not None else sys.argv[1:])
    emit(result, args.json, table)


if __name__ == "__main__":
    main()
