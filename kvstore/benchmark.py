"""``kvstore bench``: throughput and latency of a pool through the SDK, next to baselines.

    kvstore bench [--master HOST:PORT] [--sizes 64KiB,1MiB,4MiB] [--clients 1,4] [--json] [--plot FILE]
    python -m bench.throughput ...          (the same, from a checkout)

What runs where (nothing measured shares an interpreter with what it talks to):

- the pool: by default a master and one storage node in a process of their
  own (``kvstore up`` in miniature: DRAM only, prefaulted, sized so the
  working set never evicts), or the pool at ``--master``;
- clients: ``--clients`` levels of 1..N processes (multiprocessing, spawn),
  each with its own ``Client`` per transport; every measurement starts them
  together at a barrier; aggregate GB/s = all bytes / the slowest client's
  wall time;
- baselines, with the same values, the same working set and the same client
  processes: ``memcpy`` (numpy.copyto of each value into a preallocated
  buffer), ``socket`` (a raw Python request/response server in a process of its
  own: a 16-byte request answered with the value via sendall / received with
  recv_into, one byte back for a put), ``redis`` (redis-server started here on a
  free loopback port, persistence off; redis-py GET / SET, pipelines of
  ``--batch`` for the batch ops) and ``redis_c`` (redis-benchmark, the C
  client, on the same server: ``-t get|set -d SIZE -n N -c CLIENTS -P 1`` or
  ``-P BATCH`` for batch ops, ``-r`` over a preloaded working set of the same
  size). A missing baseline is null in the JSON with a note, never estimated.

Rounds of all measures are interleaved and each figure is the median over
``--rounds`` rounds; each ratio is the median of the per-round ratios.
Latency is per call (a batch call or a pipeline counts once), pooled over
clients and rounds. Client location caches are kept warm for the run: the
figures are the data path, not the master's Locate.
"""

from __future__ import annotations

import csv
import io
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

OPS = ("put", "get", "get_into", "batch_put", "batch_get", "batch_get_into")
TRANSPORTS = ("tcp", "shm")
MiB = 1 << 20
_REQ = struct.Struct("<QQ")  # raw socket baseline request: (op 0 get / 1 put, size)


@dataclass
class Settings:
    sizes: list[int]
    ops: list[str] = field(default_factory=lambda: list(OPS))
    transports: list[str] = field(default_factory=lambda: list(TRANSPORTS))
    clients: list[int] = field(default_factory=lambda: [1, 4])
    bytes_per_client: int = 64 * MiB  # working set of each client at each size
    batch: int = 64
    rounds: int = 5
    master: str | None = None
    dram: int | None = None  # of the pool started here; None: enough for the working set, twice
    redis: bool = True
    redis_server: str = "redis-server"
    redis_benchmark: str = "redis-benchmark"
    progress: bool = True

    def count(self, size: int) -> int:
        """Blocks per client at ``size``: the working set, at least one batch."""
        return max(self.bytes_per_client // size, self.batch)


# -- processes the benchmark starts -----------------------------------------------------------------
@contextmanager
def embedded_pool(dram: int):
    """A master and one storage node in this process, on free loopback ports (for tests and
    examples; the benchmark runs its pool in a process of its own, see ``_serve_pool``)."""
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


def _serve_pool(conn, dram: int, max_block: int) -> None:
    """A master and one node (DRAM only, prefaulted) until ``conn`` closes. Runs in its own process."""
    from kvstore.master.server import MasterServer
    from kvstore.node.config import StoreConfig
    from kvstore.node.daemon import NodeOptions, StorageNode

    master = MasterServer(host="127.0.0.1", port=0, ttl_s=5.0, heartbeat_interval_s=0.5).start()
    with tempfile.TemporaryDirectory() as tmp:
        config = StoreConfig(dram_capacity=dram, max_block_bytes=max_block, prefault=True)
        node = StorageNode(config, NodeOptions(master=master.address, port=0, data_dir=tmp)).start()
        deadline = time.monotonic() + 10
        while not node.agent.registered and time.monotonic() < deadline:
            time.sleep(0.02)
        conn.send({"master": master.address, "node": node.node_id})
        try:
            conn.recv()
        except EOFError:
            pass
        node.stop()
        master.stop()


def _serve_socket(conn, sizes: list[int], counts: list[int]) -> None:
    """The raw request/response baseline: one thread per connection. Runs in its own process."""
    rng = np.random.default_rng(7)
    blocks = {s: rng.integers(0, 256, (c, s), dtype=np.uint8) for s, c in zip(sizes, counts)}
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)

    def serve(sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head, i = bytearray(_REQ.size), 0
        scratch = {s: np.empty(s, dtype=np.uint8) for s in sizes}
        with sock:
            while sock.recv_into(head, _REQ.size, socket.MSG_WAITALL) == _REQ.size:
                op, size = _REQ.unpack(head)
                if op == 0:
                    sock.sendall(blocks[size][i % len(blocks[size])])
                else:
                    view, got = memoryview(scratch[size]), 0
                    while got < size:
                        got += sock.recv_into(view[got:], size - got)
                    sock.sendall(b"\x00")
                i += 1

    def accept() -> None:
        while True:
            sock, _ = listener.accept()
            threading.Thread(target=serve, args=(sock,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    conn.send("127.0.0.1:%d" % listener.getsockname()[1])
    try:
        conn.recv()
    except EOFError:
        pass


class Child:
    """A spawned helper process that sends one message when ready and runs until ``close``."""

    def __init__(self, ctx, target, *args):
        self._conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child_conn, *args), daemon=True)
        self.proc.start()
        child_conn.close()
        if not self._conn.poll(120):
            self.close()
            raise RuntimeError(f"{target.__name__} did not start")
        self.info = self._conn.recv()

    def close(self) -> None:
        try:
            self._conn.send(None)
        except OSError:
            pass
        self._conn.close()
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """redis-server on a free loopback port, no persistence, until ``close``."""

    def __init__(self, binary: str):
        self.port = free_port()
        self.proc = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--protected-mode", "no", "--loglevel", "warning",
                                      "--dir", tempfile.gettempdir()],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
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


def redis_c_rate(binary: str, port: int, test: str, size: int, requests: int, clients: int, pipeline: int,
                 keyspace: int) -> tuple[float, float | None, float | None]:
    """redis-benchmark's (requests/s, p50 ms, p99 ms) for one test (get or set)."""
    args = [binary, "-p", str(port), "-t", test, "-d", str(size), "-n", str(requests), "-c", str(clients),
            "-P", str(pipeline), "-r", str(keyspace), "-q", "--csv"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=600, check=True).stdout
    rows = list(csv.DictReader(io.StringIO(out)))
    if not rows:
        raise RuntimeError(f"redis-benchmark printed no result: {out!r}")
    row = rows[0]
    p50, p99 = row.get("p50_latency_ms"), row.get("p99_latency_ms")
    return float(row["rps"]), float(p50) if p50 else None, float(p99) if p99 else None


# -- client processes --------------------------------------------------------------------------------
class Worker:
    """State of one client process: a Client per transport, a socket, a redis connection, values."""

    def __init__(self, index: int, master: str, socket_address: str | None, redis_port: int | None):
        self.index, self.master = index, master
        self.socket_address, self.redis_port = socket_address, redis_port
        self.clients: dict = {}
        self.sock = None
        self.redis = None
        self.size = 0

    def client(self, transport: str):
        from kvstore_client.client import Client

        if transport not in self.clients:
            self.clients[transport] = Client(self.master, data_path=transport, location_ttl=3600.0)
        return self.clients[transport]

    def prepare(self, size: int, count: int, batch: int, populate: list[str]) -> dict:
        """Values (a cold working set), destination buffers, the blocks the gets read."""
        self.size, self.count, self.batch = size, count, batch
        self.values = np.random.default_rng(1000 * self.index + 7).integers(0, 256, (count, size), dtype=np.uint8)
        self.dst = [np.empty(size, dtype=np.uint8) for _ in range(batch)]
        self.keys = [(f"bench-{self.index}", i.to_bytes(16, "little")) for i in range(count)]
        self.rkeys = [f"bench:{self.index}:{size}:{i}" for i in range(count)]
        paths = {}
        if "kvstore" in populate:
            for transport in self.clients_wanted:
                c = self.client(transport)
                for start in range(0, count, batch):
                    c.batch_put(self.keys[start : start + batch], list(self.values[start : start + batch]))
                conns = getattr(c._local, "conns", {})
                paths[transport] = sorted({type(x).__name__ for x in conns.values()})
        if "redis" in populate and self.redis_port:
            r = self._redis()
            for start in range(0, count, batch):
                pipe = r.pipeline(transaction=False)
                for i in range(start, min(count, start + batch)):
                    pipe.set(self.rkeys[i], memoryview(self.values[i]))
                pipe.execute()
        return {"paths": paths}

    def _redis(self):
        if self.redis is None:
            import redis

            self.redis = redis.Redis(port=self.redis_port)
        return self.redis

    def _socket(self):
        if self.sock is None:
            host, port = self.socket_address.rsplit(":", 1)
            self.sock = socket.create_connection((host, int(port)))
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self.sock

    def calls(self, measure: str, limit: int | None = None):
        """The measure as a list of zero-argument calls (each one timed), over the working set."""
        n = self.count if limit is None else min(limit, self.count)
        size, batch, keys, values, dst = self.size, self.batch, self.keys, self.values, self.dst
        singles, batches = range(n), [range(s, min(n, s + batch)) for s in range(0, n, batch)]
        kind, _, rest = measure.partition(":")
        if kind == "kv":
            transport, op = rest.split(":")
            c = self.client(transport)
            return {
                "put": lambda: [lambda i=i: c.put(keys[i], values[i]) for i in singles],
                "get": lambda: [lambda i=i: _must(c.get(keys[i])) for i in singles],
                "get_into": lambda: [lambda i=i: _must(c.get_into(keys[i], dst[0])) for i in singles],
                "batch_put": lambda: [lambda b=b: c.batch_put([keys[i] for i in b], [values[i] for i in b])
                                      for b in batches],
                "batch_get": lambda: [lambda b=b: _must_all(c.batch_get([keys[i] for i in b])) for b in batches],
                "batch_get_into": lambda: [lambda b=b: _must_all(c.batch_get_into([keys[i] for i in b],
                                                                                  dst[: len(b)])) for b in batches],
            }[op]()
        if kind == "memcpy":
            return [lambda i=i: np.copyto(dst[0], values[i]) for i in singles]
        if kind == "socket":
            sock, view = self._socket(), memoryview(dst[0])
            get_req, put_req = _REQ.pack(0, size), _REQ.pack(1, size)

            def sget():
                sock.sendall(get_req)
                got = 0
                while got < size:
                    got += sock.recv_into(view[got:], size - got)

            def sput(i):
                sock.sendall(put_req)
                sock.sendall(values[i])
                sock.recv(1)

            return [sget for _ in singles] if rest == "get" else [lambda i=i: sput(i) for i in singles]
        if kind == "redis":
            r, rkeys = self._redis(), self.rkeys

            def pipeline(b, op):
                pipe = r.pipeline(transaction=False)
                for i in b:
                    pipe.get(rkeys[i]) if op == "get" else pipe.set(rkeys[i], memoryview(values[i]))
                out = pipe.execute()
                if op == "get":
                    _must_all(out)

            return {
                "get": lambda: [lambda i=i: _must(r.get(rkeys[i])) for i in singles],
                "set": lambda: [lambda i=i: r.set(rkeys[i], memoryview(values[i])) for i in singles],
                "pipe_get": lambda: [lambda b=b: pipeline(b, "get") for b in batches],
                "pipe_set": lambda: [lambda b=b: pipeline(b, "set") for b in batches],
            }[rest]()
        raise ValueError(f"unknown measure {measure}")


def _must(value):
    if value is None:
        raise RuntimeError("benchmark block missing: was it evicted? (the pool is smaller than the working set)")
    return value


def _must_all(values):
    for v in values:
        _must(v)
    return values


def _worker_main(conn, barrier, index: int, master: str, socket_address, redis_port, transports) -> None:
    worker = Worker(index, master, socket_address, redis_port)
    worker.clients_wanted = transports
    try:
        while True:
            task = conn.recv()
            if task is None:
                break
            try:
                if task["type"] == "prepare":
                    conn.send(worker.prepare(task["size"], task["count"], task["batch"], task["populate"]))
                    continue
                calls = worker.calls(task["measure"], task.get("limit"))
                barrier.wait(60)
                lat = []
                clock = time.perf_counter
                start = clock()
                for call in calls:
                    t0 = clock()
                    call()
                    lat.append(clock() - t0)
                end = clock()
                n = min(task.get("limit") or worker.count, worker.count)
                conn.send({"bytes": n * worker.size, "ops": n, "elapsed": end - start, "latencies": lat})
            except Exception as exc:  # report, keep serving (a broken barrier resets in the parent)
                conn.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        for c in worker.clients.values():
            c.close()


class ClientGroup:
    """``n`` client processes started together for every measurement."""

    def __init__(self, ctx, n: int, master: str, socket_address, redis_port, transports):
        self.n, self.ctx = n, ctx
        self.barrier = ctx.Barrier(n)
        self.conns, self.procs = [], []
        for i in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, args=(child, self.barrier, i, master, socket_address, redis_port,
                                                      transports), daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)

    def ask(self, task: dict) -> list[dict]:
        for c in self.conns:
            c.send(task)
        replies = [c.recv() for c in self.conns]
        errors = [r["error"] for r in replies if "error" in r]
        if errors:
            self.barrier.reset()
            raise RuntimeError(f"{task.get('measure', task['type'])}: {errors[0]}")
        return replies

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except OSError:
                pass
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()


# -- the run -----------------------------------------------------------------------------------------
BASELINES = {  # op -> (redis-py measure, redis-benchmark test, batch?, raw socket measure)
    "put": ("redis:set", "set", False, "socket:put"),
    "batch_put": ("redis:pipe_set", "set", True, "socket:put"),
    "get": ("redis:get", "get", False, "socket:get"),
    "get_into": ("redis:get", "get", False, "socket:get"),
    "batch_get": ("redis:pipe_get", "get", True, "socket:get"),
    "batch_get_into": ("redis:pipe_get", "get", True, "socket:get"),
}


class Progress:
    """tqdm on stderr when installed, else a plain counter line; nothing when disabled."""

    def __init__(self, total: int, enabled: bool):
        self.bar, self.done, self.total, self.enabled = None, 0, total, enabled
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="measure", file=sys.stderr, leave=False, dynamic_ncols=True)
            except ImportError:
                pass

    def step(self, label: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_description(label, refresh=False)
            self.bar.update()
        elif self.enabled:
            sys.stderr.write(f"\r{self.done}/{self.total} {label:<40}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            sys.stderr.write("\n")


def _redis_status(settings: Settings) -> tuple[str | None, str | None, list[str]]:
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
        return None, None, [f"Redis baselines skipped: {settings.redis_server} not found "
                            "(apt-get install redis-server)"]
    bench = shutil.which(settings.redis_benchmark)
    if bench is None:
        notes.append(f"redis-benchmark (C client) baseline skipped: {settings.redis_benchmark} not found "
                     "(apt-get install redis-tools)")
    return server, bench, notes


def _measures(settings: Settings, redis_py: bool) -> list[str]:
    out = [f"kv:{t}:{op}" for op in settings.ops for t in settings.transports]
    out += ["memcpy"] + sorted({BASELINES[op][3] for op in settings.ops})
    if redis_py:
        out += sorted({BASELINES[op][0] for op in settings.ops})
    return out


def _redis_c_tests(settings: Settings) -> list[tuple[str, bool]]:
    return sorted({(BASELINES[op][1], BASELINES[op][2]) for op in settings.ops})


def run(settings: Settings) -> dict:
    """Every (size, op, transport, clients) with its baselines; see the module docstring."""
    ctx = mp.get_context("spawn")
    redis_bin, redis_c_bin, notes = _redis_status(settings)
    counts = [settings.count(s) for s in settings.sizes]
    need = max(c * s for c, s in zip(counts, settings.sizes)) * max(settings.clients)
    dram = settings.dram or 2 * need + 256 * MiB
    helpers = []
    redis = None
    try:
        if settings.master:
            master = settings.master
            notes.append(f"pool at {master}: its DRAM must hold {need / MiB:.0f} MiB (the working set) "
                         "or gets miss")
        else:
            pool = Child(ctx, _serve_pool, dram, max(settings.sizes))
            helpers.append(pool)
            master = pool.info["master"]
        sock = Child(ctx, _serve_socket, settings.sizes, counts)
        helpers.append(sock)
        if redis_bin:
            try:
                redis = RedisServer(redis_bin)
            except (RuntimeError, OSError) as exc:
                notes.append(f"Redis baselines skipped: {exc}")
                redis_c_bin = None
        if redis is not None:
            import redis as redis_py

            parser = "hiredis" if getattr(redis_py.utils, "HIREDIS_AVAILABLE", False) else "pure-Python parser"
            notes.append(f"redis-py {redis_py.__version__} ({parser}); "
                         f"{subprocess.run([redis_bin, '--version'], capture_output=True, text=True).stdout.split()[2]}")
        raw = _run_levels(ctx, settings, master, sock.info, redis, redis_c_bin, notes)
    finally:
        if redis is not None:
            redis.close()
        for h in reversed(helpers):
            h.close()
    records = _records(settings, raw, redis is not None, redis_c_bin is not None)
    return {"config": _config(settings, dram, master if settings.master else None), "notes": notes,
            "records": records, "targets": targets(records)}


def _config(settings: Settings, dram: int, master) -> dict:
    return {"sizes": settings.sizes, "ops": settings.ops, "transports": settings.transports,
            "clients": settings.clients, "bytes_per_client": settings.bytes_per_client, "batch": settings.batch,
            "rounds": settings.rounds, "master": master, "pool_dram": None if master else dram,
            "cpus": os.cpu_count()}


def _run_levels(ctx, settings: Settings, master: str, socket_address: str, redis, redis_c_bin, notes) -> dict:
    """{(clients, size, measure): [per-round dicts of gbps, ops_s, latencies]}."""
    measures = _measures(settings, redis is not None)
    c_tests = _redis_c_tests(settings) if redis_c_bin else []
    total = len(settings.clients) * len(settings.sizes) * settings.rounds * (len(measures) + len(c_tests))
    progress = Progress(total, settings.progress)
    raw: dict = {}
    try:
        for n in settings.clients:
            group = ClientGroup(ctx, n, master, socket_address, redis.port if redis else None, settings.transports)
            try:
                for size in settings.sizes:
                    count = settings.count(size)
                    if redis is not None:
                        redis.client.flushall()
                        if c_tests:
                            _preload_redis_c(redis, size, count * n, settings.batch)
                    prepared = group.ask({"type": "prepare", "size": size, "count": count, "batch": settings.batch,
                                          "populate": ["kvstore", "redis"]})
                    _note_paths(notes, prepared[0]["paths"])
                    for m in measures:  # warm-up: connections, page tables, caches
                        group.ask({"type": "run", "measure": m, "limit": 2 * settings.batch})
                    for _ in range(settings.rounds):
                        for m in measures:
                            progress.step(f"{n} clients {_label(size)} {m}")
                            raw.setdefault((n, size, m), []).append(_aggregate(group.ask({"type": "run",
                                                                                           "measure": m})))
                        for test, batched in c_tests:
                            progress.step(f"{n} clients {_label(size)} redis-benchmark {test}")
                            pipeline = settings.batch if batched else 1
                            rps, p50, p99 = redis_c_rate(redis_c_bin, redis.port, test, size, count * n, n, pipeline,
                                                         count * n)
                            raw.setdefault((n, size, f"redis_c:{test}:{pipeline}"), []).append(
                                {"gbps": rps * size / 1e9, "ops_s": rps, "p50_ms": p50, "p99_ms": p99})
            finally:
                group.close()
    finally:
        progress.close()
    return raw


def _preload_redis_c(redis, size: int, keys: int, batch: int) -> None:
    """The keys redis-benchmark -r reads ("key:" + 12 digits), each holding a value of ``size`` bytes."""
    value = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    for start in range(0, keys, batch):
        pipe = redis.client.pipeline(transaction=False)
        for i in range(start, min(keys, start + batch)):
            pipe.set(f"key:{i:012d}", value)
        pipe.execute()


def _note_paths(notes: list[str], paths: dict) -> None:
    for transport, kinds in paths.items():
        expected = {"tcp": "TcpConnection", "shm": "ShmConnection"}.get(transport)
        if expected and kinds != [expected]:
            note = f"transport {transport}: the SDK used {', '.join(kinds) or 'nothing'} (the node is not reachable that way)"
            if note not in notes:
                notes.append(note)


def _aggregate(replies: list[dict]) -> dict:
    """All clients' bytes over the slowest client's wall time; latencies pooled."""
    slowest = max(r["elapsed"] for r in replies)
    lat = [x for r in replies for x in r["latencies"]]
    return {"gbps": sum(r["bytes"] for r in replies) / slowest / 1e9,
            "ops_s": sum(r["ops"] for r in replies) / slowest, "latencies": lat}


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _pct(sorted_lat: list[float], q: float) -> float:
    return sorted_lat[min(len(sorted_lat) - 1, int(q * len(sorted_lat)))]


def _records(settings: Settings, raw: dict, redis_py: bool, redis_c: bool) -> list[dict]:
    out = []
    for n in settings.clients:
        for size in settings.sizes:
            for op in settings.ops:
                py_measure, c_test, batched, sock_measure = BASELINES[op]
                c_measure = f"redis_c:{c_test}:{settings.batch if batched else 1}"
                for transport in settings.transports:
                    rounds = raw[(n, size, f"kv:{transport}:{op}")]
                    lat = sorted(x for r in rounds for x in r["latencies"])
                    rec = {"size": size, "size_label": _label(size), "op": op, "transport": transport,
                           "clients": n, "batch": settings.batch if op.startswith("batch") else 1,
                           "kvstore_gbps": _round(_median(r["gbps"] for r in rounds)),
                           "kvstore_ops_s": _round(_median(r["ops_s"] for r in rounds), 1),
                           "p50_ms": _round(1e3 * _pct(lat, 0.5), 4), "p99_ms": _round(1e3 * _pct(lat, 0.99), 4),
                           "notes": []}
                    for field_name, measure, present, why in (
                            ("redis_gbps", py_measure, redis_py, "Redis (redis-py) not measured: see notes"),
                            ("redis_c_gbps", c_measure, redis_c, "redis-benchmark not measured: see notes"),
                            ("socket_gbps", sock_measure, True, ""), ("memcpy_gbps", "memcpy", True, "")):
                        base = raw.get((n, size, measure)) if present else None
                        prefix = field_name[: -len("_gbps")]
                        if base is None:
                            rec[field_name] = rec[f"vs_{prefix}"] = None
                            rec["notes"].append(why)
                            continue
                        rec[field_name] = _round(_median(b["gbps"] for b in base))
                        rec[f"vs_{prefix}"] = _round(_median(a["gbps"] / b["gbps"] for a, b in zip(rounds, base)))
                        if prefix in ("redis", "redis_c"):
                            blat = sorted(x for b in base for x in b.get("latencies", ()))
                            rec[f"{prefix}_p50_ms"] = (_round(1e3 * _pct(blat, 0.5), 4) if blat
                                                       else _round(_median(b["p50_ms"] for b in base), 4))
                    out.append(rec)
    return out


def _round(value, digits: int = 3):
    return None if value is None else round(value, digits)


def _label(size: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift and size % (1 << shift) == 0:
            return f"{size >> shift}{unit}"
    return str(size)


# -- targets, table, plot ------------------------------------------------------------------------------
TARGETS = [  # (name, size, clients, transport, op, ratio field, at least)
    ("1MiB 1 client: TCP get_into >= 3x Redis GET (redis-py)", MiB, 1, "tcp", "get_into", "vs_redis", 3.0),
    ("1MiB 1 client: TCP get_into >= 0.8x Redis GET (redis-benchmark)", MiB, 1, "tcp", "get_into", "vs_redis_c", 0.8),
    ("1MiB 1 client: TCP get >= 3x Redis GET (redis-py)", MiB, 1, "tcp", "get", "vs_redis", 3.0),
    ("1MiB 1 client: TCP get >= 0.8x Redis GET (redis-benchmark)", MiB, 1, "tcp", "get", "vs_redis_c", 0.8),
    ("1MiB 1 client: TCP put >= 2x Redis SET (redis-py)", MiB, 1, "tcp", "put", "vs_redis", 2.0),
    ("1MiB 1 client: shm get_into >= 0.6x memcpy", MiB, 1, "shm", "get_into", "vs_memcpy", 0.6),
    ("1MiB 1 client: shm put >= 0.5x memcpy", MiB, 1, "shm", "put", "vs_memcpy", 0.5),
    ("64KiB 1 client: TCP batch_get_into (64) >= 3x redis-py GET pipeline (64)", 64 << 10, 1, "tcp",
     "batch_get_into", "vs_redis", 3.0),
    ("64KiB 1 client: shm batch_get_into (64) >= 3x redis-py GET pipeline (64)", 64 << 10, 1, "shm",
     "batch_get_into", "vs_redis", 3.0),
    ("1MiB 4 clients: aggregate TCP get_into >= 0.7x raw socket (4 clients)", MiB, 4, "tcp", "get_into",
     "vs_socket", 0.7),
]


def targets(records: list[dict]) -> list[dict]:
    index = {(r["size"], r["clients"], r["transport"], r["op"]): r for r in records}
    out = []
    for name, size, clients, transport, op, ratio, least in TARGETS:
        rec = index.get((size, clients, transport, op))
        value = None if rec is None else rec.get(ratio)
        out.append({"target": name, "ratio": value, "at_least": least,
                    "met": None if value is None else value >= least})
    return out


def format_table(result: dict) -> str:
    def cell(rec, prefix):
        g = rec.get(f"{prefix}_gbps")
        return "-" if g is None else f"{g:.2f} ({rec[f'vs_{prefix}']:.2f}x)"

    header = ["size", "op", "transport", "clients", "kvstore GB/s", "ops/s", "p50 ms", "p99 ms",
              "redis-py GB/s (kv/x)", "redis-benchmark GB/s", "raw socket GB/s", "memcpy GB/s"]
    rows = [[r["size_label"], r["op"], r["transport"], r["clients"], f"{r['kvstore_gbps']:.2f}",
             f"{r['kvstore_ops_s']:,.0f}", r["p50_ms"], r["p99_ms"], cell(r, "redis"), cell(r, "redis_c"),
             cell(r, "socket"), cell(r, "memcpy")] for r in result["records"]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in rows]
    lines.append("\nbaseline cells: baseline GB/s (kvstore / baseline, median of per-round ratios)")
    for t in result["targets"]:
        state = "not measured" if t["met"] is None else ("met" if t["met"] else "MISSED")
        ratio = "-" if t["ratio"] is None else f"{t['ratio']:.2f}"
        lines.append(f"target {t['target']}: {ratio} -> {state}")
    lines += [f"note: {n}" for n in result["notes"]]
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Throughput against value size (one client): kvstore tcp and shm, Redis (both clients), the limits."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib (pip install 'kvstore[bench]')") from exc
    clients = min(result["config"]["clients"])
    recs = [r for r in result["records"] if r["clients"] == clients]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    for ax, (title, op, batch_op) in zip(axes, (("get (get_into)", "get_into", "batch_get_into"),
                                                ("put", "put", "batch_put"))):
        series = {}
        for r in recs:
            if r["op"] == op:
                series.setdefault(f"kvstore {r['transport']} {op}", {})[r["size"]] = r["kvstore_gbps"]
                for prefix, label in (("redis", "Redis, redis-py"), ("redis_c", "Redis, redis-benchmark (C)"),
                                      ("socket", "limit: raw Python socket"), ("memcpy", "limit: memcpy")):
                    if r.get(f"{prefix}_gbps") is not None:
                        series.setdefault(label, {})[r["size"]] = r[f"{prefix}_gbps"]
            elif r["op"] == batch_op:
                series.setdefault(f"kvstore {r['transport']} {batch_op} ({r['batch']})", {})[r["size"]] = \
                    r["kvstore_gbps"]
        for label, points in series.items():
            xs = sorted(points)
            style = "--" if label.startswith("limit") else (":" if "Redis" in label else "-")
            ax.plot([x / 1024 for x in xs], [points[x] for x in xs], style, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("value size (KiB)")
        ax.set_title(f"{title}, {clients} client{'s' if clients > 1 else ''}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("GB/s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def emit(result: dict, as_json: bool, plot_path: str | None, echo=print) -> None:
    if plot_path:
        plot(result, plot_path)
    echo(json.dumps(result, indent=2) if as_json else format_table(result))
