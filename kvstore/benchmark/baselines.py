"""The baselines next to kvstore: a raw socket server, redis-server, redis-benchmark (memcpy runs in the workers)."""

from __future__ import annotations

import csv
import io
import shutil
import socket
import struct
import subprocess
import tempfile
import threading
import time

import numpy as np

from kvstore.benchmark.settings import Settings

SOCKET_REQUEST = struct.Struct("<QQ")  # raw socket baseline request: (op 0 get / 1 put, size)


# -- raw socket ----------------------------------------------------------------------------------------
def _serve_socket_connection(sock: socket.socket, sizes: list[int], blocks: dict) -> None:
    """Answer one connection's requests: a get with a value (sendall), a put (recv_into) with one byte."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    head, i = bytearray(SOCKET_REQUEST.size), 0
    scratch = {s: np.empty(s, dtype=np.uint8) for s in sizes}
    with sock:
        while sock.recv_into(head, SOCKET_REQUEST.size, socket.MSG_WAITALL) == SOCKET_REQUEST.size:
            op, size = SOCKET_REQUEST.unpack(head)
            if op == 0:
                sock.sendall(blocks[size][i % len(blocks[size])])
            else:
                view, got = memoryview(scratch[size]), 0
                while got < size:
                    got += sock.recv_into(view[got:], size - got)
                sock.sendall(b"\x00")
            i += 1


def socket_client(address: str) -> socket.socket:
    """A connection to the raw socket baseline server at "host:port" (Nagle off, as kvstore's)."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def socket_get(sock: socket.socket, view: memoryview, request: bytes) -> None:
    """One get from the raw socket baseline server: send ``request``, receive a block into ``view``."""
    sock.sendall(request)
    size, got = len(view), 0
    while got < size:
        got += sock.recv_into(view[got:], size - got)


def serve_socket(conn, sizes: list[int], counts: list[int]) -> None:
    """The raw request/response baseline: one thread per connection. Runs in its own process."""
    rng = np.random.default_rng(7)
    blocks = {s: rng.integers(0, 256, (c, s), dtype=np.uint8) for s, c in zip(sizes, counts)}
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)

    def accept() -> None:
        while True:
            sock, _ = listener.accept()
            threading.Thread(target=_serve_socket_connection, args=(sock, sizes, blocks), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    conn.send("127.0.0.1:%d" % listener.getsockname()[1])
    try:
        conn.recv()
    except EOFError:
        pass


# -- Redis -----------------------------------------------------------------------------------------------
def redis_status(settings: Settings) -> tuple[str | None, str | None, list[str]]:
    """(redis-server path, redis-benchmark path, notes) of what is usable."""
    notes = []
    if not settings.redis:
        return None, None, ["Redis baselines skipped: --no-redis"]
    try:
        import redis  # noqa: F401
    except ImportError:
        return None, None, ["Redis baselines skipped: redis-py is not installed (pip install 'kvstore[bench]')"]
    server = shutil.which(settings.redis_server)
    if server is None:
        return (
            None,
            None,
            [f"Redis baselines skipped: {settings.redis_server} not found (apt-get install redis-server)"],
        )
    bench = shutil.which(settings.redis_benchmark)
    if bench is None:
        notes.append(
            f"redis-benchmark (C client) baseline skipped: {settings.redis_benchmark} not found "
            "(apt-get install redis-tools)"
        )
    return server, bench, notes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """redis-server on a free loopback port, no persistence, until ``close``."""

    def __init__(self, binary: str):
        self.port = free_port()
        self.proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
                "--loglevel",
                "warning",
                "--dir",
                tempfile.gettempdir(),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )  # Ctrl-C is ours to handle: close() stops it
        import redis

        self.client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client.ping()
                return
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    err = self.proc.stderr.read().decode(errors="replace") if self.proc.poll() is not None else ""
                    self.close()
                    raise RuntimeError(f"redis-server did not start: {err.strip()}") from None
                time.sleep(0.05)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def preload_redis_c(redis: RedisServer, size: int, keys: int, batch: int) -> None:
    """The keys redis-benchmark -r reads ("key:" + 12 digits), each holding a value of ``size`` bytes."""
    value = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    for start in range(0, keys, batch):
        pipe = redis.client.pipeline(transaction=False)
        for i in range(start, min(keys, start + batch)):
            pipe.set(f"key:{i:012d}", value)
        pipe.execute()


def redis_c_rate(
    binary: str, port: int, test: str, size: int, requests: int, clients: int, pipeline: int, keyspace: int
) -> tuple[float, float | None, float | None]:
    """redis-benchmark's (requests/s, p50 ms, p99 ms) for one test (get or set)."""
    args = [
        binary,
        "-p",
        str(port),
        "-t",
        test,
        "-d",
        str(size),
        "-n",
        str(requests),
        "-c",
        str(clients),
        "-P",
        str(pipeline),
        "-r",
        str(keyspace),
        "-q",
        "--csv",
    ]
    out = subprocess.run(args, capture_output=True, text=True, timeout=600, check=True).stdout
    rows = list(csv.DictReader(io.StringIO(out)))
    if not rows:
        raise RuntimeError(f"redis-benchmark printed no result: {out!r}")
    row = rows[0]
    p50, p99 = row.get("p50_latency_ms"), row.get("p99_latency_ms")
    return float(row["rps"]), float(p50) if p50 else None, float(p99) if p99 else None
