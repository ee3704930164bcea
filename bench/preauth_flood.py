"""Authenticated clients against a flood of connections that never authenticate.

    python -m bench.preauth_flood --connections 2000 --json

A master and one node with an access file (real processes, ``bench.cluster``). A flood process
holds ``--connections`` TCP connections to each listener under test (the node's data plane and
the master's conductor port), each sending one byte every ``--trickle`` seconds (never a whole
handshake) and opened again as soon as the service drops it, at up to ``--reopen-rate`` a
second. Without the flood and then under it, in the same run:

- ``get``: an authenticated data-plane connection's GETs of one 64 KiB block (latency);
- ``connect``: new data-plane connections (TCP connect, the AUTH exchange, INFO; latency and
  failures);
- ``schedule``: a new conductor-port link per call (connect, AUTH, one Schedule; latency and
  failures).

Each operation is run once untimed first (a cold first call is not the pool's p99).

Reported: p50 and p99 of each, failures, and p99 under the flood over p99 idle
(``*_p99_vs_idle``); the target is authenticated clients still served (no failures) with p99
within 2x of the idle pool. Figures go to docs/benchmarks.md with the command and machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import selectors
import socket
import statistics
import tempfile
import time
from pathlib import Path

from bench.cluster import ADMIN_TOKEN, start_master, start_node, write_access_file

KiB = 1 << 10


def flood(targets: list[str], per_target: int, trickle: float, reopen_rate: float, seconds: float, out) -> None:
    """Hold ``per_target`` trickling, never-authenticating connections to each target for
    ``seconds``; send back how many connections were opened in all."""
    selector = selectors.DefaultSelector()
    due: dict[socket.socket, float] = {}
    opened, budget, last = 0, reopen_rate, time.monotonic()

    def open_one(address: str) -> None:
        nonlocal opened
        host, port = address.rsplit(":", 1)
        sock = socket.socket()
        sock.setblocking(False)
        try:
            sock.connect_ex((host, int(port)))
        except OSError:
            sock.close()
            return
        selector.register(sock, selectors.EVENT_READ, address)
        due[sock] = time.monotonic() + trickle * (opened % 97) / 97  # spread the trickles out
        opened += 1

    for address in targets:
        for _ in range(per_target):
            open_one(address)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        now = time.monotonic()
        budget = min(reopen_rate, budget + (now - last) * reopen_rate)
        last = now
        for key, _ in selector.select(timeout=0.05):  # the service closed it (or answered): open another
            sock = key.fileobj
            try:
                if sock.recv(4096):
                    continue
            except BlockingIOError:
                continue
            except OSError:
                pass
            selector.unregister(sock)
            due.pop(sock, None)
            sock.close()
            if budget >= 1:
                budget -= 1
                open_one(key.data)
        for sock, when in list(due.items()):
            if when <= now:
                try:
                    sock.send(b"\x4b")
                except OSError:
                    pass
                due[sock] = now + trickle
        missing = len(targets) * per_target - len(due)
        while missing > 0 and budget >= 1:
            budget -= 1
            missing -= 1
            open_one(targets[missing % len(targets)])
    out.send(opened)


def percentiles(samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {
        "p50_ms": round(statistics.median(ordered) * 1e3, 3),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e3, 3),
    }


def measure(data: str, conductor: str, namespace: str, calls: int) -> dict:
    """Latency and failures of each authenticated operation, ``calls`` of each."""
    from kvstore_client.conductor_link import ConductorLink
    from kvstore_client.credentials import Credentials
    from kvstore_client.transport import TcpConnection

    credentials = Credentials(ADMIN_TOKEN)
    figures: dict[str, dict] = {}
    key = (namespace, b"k" * 16)
    with TcpConnection(data, credentials=credentials, timeout=30) as conn:
        conn.put(key, os.urandom(64 * KiB))
        took = []
        for _ in range(calls):
            start = time.perf_counter()
            conn.get(key)
            took.append(time.perf_counter() - start)
        figures["get"] = {**percentiles(took), "failures": 0}
    took, failures = [], 0
    for i in range(calls // 5 + 1):  # the first one warms up, untimed
        start = time.perf_counter()
        try:
            TcpConnection(data, credentials=credentials, timeout=30).close()
            if i == 0:
                continue
            took.append(time.perf_counter() - start)
        except Exception:
            failures += 1
    figures["connect"] = {**(percentiles(took) if took else {}), "failures": failures}

    async def schedules() -> tuple[list[float], int]:
        took, failures = [], 0
        for i in range(calls // 5 + 1):  # the first one warms up, untimed
            start = time.perf_counter()
            link = ConductorLink(conductor, token=ADMIN_TOKEN, timeout=30)
            try:
                await link.schedule([(namespace, b"d" * 32)], 32, 1)
                if i == 0:
                    continue
                took.append(time.perf_counter() - start)
            except Exception:
                failures += 1
            finally:
                await link.close()
        return took, failures

    took, failures = asyncio.run(schedules())
    figures["schedule"] = {**(percentiles(took) if took else {}), "failures": failures}
    return figures


def run(connections: int, trickle: float, reopen_rate: float, calls: int, workdir: Path) -> dict:
    access = write_access_file(workdir)
    master = start_master(workdir, ("--auth", str(access)))
    node = None
    try:
        node = start_node(master.record["master"], workdir, "n1", "64MiB", "0", "1MiB", ("--auth", str(access)))
        from kvstore_client import Client

        namespace = "flood"
        with Client(master.record["master"], token=ADMIN_TOKEN) as client:
            node_id = node.record["node_id"]
            client.scheduling.register_engine(namespace, "P", "prefill", node_id)
            client.scheduling.register_engine(namespace, "D", "decode", node_id)
        data, conductor = node.record["data"], master.record["conductor"]
        idle = measure(data, conductor, namespace, calls)
        # spawned, not forked: a fresh interpreter, without the signal handlers or threads of its parent
        context = multiprocessing.get_context("spawn")
        receiver, sender = context.Pipe(duplex=False)
        flooder = context.Process(
            target=flood, args=([data, conductor], connections, trickle, reopen_rate, 3600.0, sender), daemon=True
        )
        flooder.start()
        time.sleep(max(3.0, connections / reopen_rate))  # every connection opened, the first dropped and back
        flooded = measure(data, conductor, namespace, calls)
        flooder.terminate()
        flooder.join(10)
        if flooder.is_alive():
            flooder.kill()
            flooder.join(10)
        result = {"connections_per_listener": connections, "trickle_s": trickle, "idle": idle, "flood": flooded}
        for op in ("get", "connect", "schedule"):
            if "p99_ms" in idle[op] and "p99_ms" in flooded[op]:
                result[f"{op}_p99_vs_idle"] = round(flooded[op]["p99_ms"] / idle[op]["p99_ms"], 2)
        result["served"] = all(flooded[op]["failures"] == 0 for op in flooded)
        result["node_alive"], result["master_alive"] = node.alive(), master.alive()
        result["tracebacks"] = node.tracebacks() + master.tracebacks()
        return result
    finally:
        if node is not None:
            node.close()
        master.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=2000, help="trickling connections per listener")
    parser.add_argument("--trickle", type=float, default=8.0, help="seconds between a flood connection's bytes")
    parser.add_argument("--reopen-rate", type=float, default=500.0, help="flood connections opened per second")
    parser.add_argument("--calls", type=int, default=500, help="authenticated GETs (a fifth as many connects)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args.connections, args.trickle, args.reopen_rate, args.calls, Path(tmp))
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
