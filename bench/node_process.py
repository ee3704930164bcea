"""A storage node in a process of its own, for bench.dataplane and bench.security_overhead.

    python -m bench.node_process --size 1MiB --count 64 --unix /tmp/dp.sock [--raw]
        [--access FILE] [--tls-cert PEM --tls-key PEM]

Builds a BlockStore with a prefaulted DRAM arena, stores ``count`` random
blocks of ``size`` bytes under ``bench_keys(count)``, serves them with a
DataPlaneServer (TCP and the Unix socket) and, with ``--raw``, also runs the
raw-socket baseline server over the same number of blocks. With ``--access``
and/or ``--tls-cert/--tls-key`` more DataPlaneServers serve the same store on
TCP ports of their own: ``auth_address`` checks the access file's tokens,
``tls_address`` is TLS without tokens, ``tls_auth_address`` both. Prints one
JSON line ({"address", "unix_path", "raw_address", and those}) once it
serves, then serves until its standard input closes (or its parent dies).
``NodeProcess`` starts and stops one.

A real deployment never shares the client's interpreter (or its GIL) with
the node, so neither does the benchmark.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import subprocess
import sys
import threading

import numpy as np

from bench.common import die_with_parent
from kvstore.node.config import StoreConfig
from kvstore.node.store import BlockStore
from kvstore.security.access import AccessList
from kvstore.security.tls import ServerTLS
from kvstore.transport.server import DataPlaneServer
from kvstore.units import parse_size

MiB = 1 << 20


def bench_keys(count: int) -> list:
    return [("bench", i.to_bytes(16, "little")) for i in range(count)]


class RawServer:
    """The TCP baseline: answers each 16-byte request with the next block via sendall, rotating over ``blocks``."""

    def __init__(self, blocks: np.ndarray):
        self.blocks = blocks
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = "%s:%d" % self.listener.getsockname()[:2]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        sock, _ = self.listener.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        request, i = bytearray(16), 0
        with sock:
            while sock.recv_into(request, 16, socket.MSG_WAITALL) == 16:
                sock.sendall(self.blocks[i % len(self.blocks)])
                i += 1


class NodeProcess:
    """Runs ``python -m bench.node_process`` until ``close``; ``info`` is its JSON line."""

    def __init__(self, size: int, count: int, unix_path: str, raw: bool = False, extra: tuple = ()):
        args = (
            [
                sys.executable,
                "-m",
                "bench.node_process",
                "--size",
                str(size),
                "--count",
                str(count),
                "--unix",
                unix_path,
            ]
            + (["--raw"] if raw else [])
            + list(extra)
        )
        self.proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent
        )
        line = self.proc.stdout.readline()
        if not line:
            self.close()
            raise RuntimeError("the benchmark node process did not start")
        self.info = json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()

    def __enter__(self) -> "NodeProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--unix", required=True)
    parser.add_argument("--raw", action="store_true", help="also run the raw-socket baseline server")
    parser.add_argument("--access", help="also serve on a port that checks this access file's tokens")
    parser.add_argument("--tls-cert", help="also serve TLS (with --tls-key) on a port of its own")
    parser.add_argument("--tls-key")
    args = parser.parse_args(argv)
    size = parse_size(args.size)
    access = AccessList.load(args.access) if args.access else None
    tls = ServerTLS.from_flags(args.tls_cert, args.tls_key, None)
    context = None if tls is None else tls.server_context()
    variants = {}  # the extra servers: their address's name in the JSON line -> (access, tls)
    if access is not None:
        variants["auth_address"] = (access, None)
    if context is not None:
        variants["tls_address"] = (None, context)
        if access is not None:
            variants["tls_auth_address"] = (access, context)
    config = StoreConfig(dram_capacity=args.count * size + 64 * MiB, max_block_bytes=size, prefault=True)
    rng = np.random.default_rng(1)
    with BlockStore(config) as store:
        for key in bench_keys(args.count):
            store.put(key, rng.integers(0, 256, size, dtype=np.uint8))
        raw = RawServer(rng.integers(0, 256, (args.count, size), dtype=np.uint8)) if args.raw else None
        with contextlib.ExitStack() as servers:
            server = servers.enter_context(DataPlaneServer(store, unix_path=args.unix))
            info = {
                "address": server.address,
                "unix_path": server.unix_path,
                "raw_address": raw.address if raw else None,
            }
            for name, (acl, tls_context) in variants.items():
                info[name] = servers.enter_context(DataPlaneServer(store, access=acl, tls=tls_context)).address
            print(json.dumps(info), flush=True)
            sys.stdin.read()


if __name__ == "__main__":
    main()
