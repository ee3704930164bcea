"""Client processes: each holds a Client per transport, a raw socket, a redis connection and its values,
and times the calls of one measure when the parent asks (all clients start together at a barrier)."""

from __future__ import annotations

import time

import numpy as np

from kvstore.benchmark.baselines import SOCKET_REQUEST, socket_client, socket_get
from kvstore.benchmark.pool import run_helper, sigint_held


def _must(value):
    if value is None:
        raise RuntimeError("benchmark block missing: was it evicted? (the pool is smaller than the working set)")
    return value


def _must_all(values):
    for v in values:
        _must(v)
    return values


def _then_wait(calls: list, wait) -> list:
    """``calls`` whose last one also runs ``wait()``: a run of puts not waited for is timed
    until the node has answered them all."""
    last = calls[-1]

    def last_and_wait():
        last()
        wait()

    return calls[:-1] + [last_and_wait]


class Worker:
    """State of one client process: a Client per transport, a socket, a redis connection, values."""

    def __init__(
        self, index: int, master: str, socket_address: str | None, redis_port: int | None, transports: list[str]
    ):
        self.index, self.master, self.transports = index, master, transports
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
            for transport in self.transports:
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
            self.sock = socket_client(self.socket_address)
        return self.sock

    def calls(self, measure: str, limit: int | None = None):
        """The measure as a list of zero-argument calls (each one timed), over the working set."""
        n = self.count if limit is None else min(limit, self.count)
        singles, batches = range(n), [range(s, min(n, s + self.batch)) for s in range(0, n, self.batch)]
        kind, _, rest = measure.partition(":")
        if kind == "kv":
            transport, op = rest.split(":")
            return self._kv_calls(transport, op, singles, batches)
        if kind == "memcpy":
            dst, values = self.dst, self.values
            return [lambda i=i: np.copyto(dst[0], values[i]) for i in singles]
        if kind == "socket":
            return self._socket_calls(rest, singles)
        if kind == "redis":
            return self._redis_calls(rest, singles, batches)
        raise ValueError(f"unknown measure {measure}")

    def _kv_calls(self, transport: str, op: str, singles, batches):
        c, keys, values, dst = self.client(transport), self.keys, self.values, self.dst
        return {
            "put": lambda: [lambda i=i: c.put(keys[i], values[i]) for i in singles],
            "put_nowait": lambda: _then_wait(
                [lambda i=i: c.put(keys[i], values[i], wait=False) for i in singles], c.wait_for_puts
            ),
            "get": lambda: [lambda i=i: _must(c.get(keys[i])) for i in singles],
            "get_into": lambda: [lambda i=i: _must(c.get_into(keys[i], dst[0])) for i in singles],
            "batch_put": lambda: [
                lambda b=b: c.batch_put([keys[i] for i in b], [values[i] for i in b]) for b in batches
            ],
            "batch_get": lambda: [lambda b=b: _must_all(c.batch_get([keys[i] for i in b])) for b in batches],
            "batch_get_into": lambda: [
                lambda b=b: _must_all(c.batch_get_into([keys[i] for i in b], dst[: len(b)])) for b in batches
            ],
        }[op]()

    def _socket_calls(self, op: str, singles):
        size, values = self.size, self.values
        sock, view = self._socket(), memoryview(self.dst[0])
        get_req, put_req = SOCKET_REQUEST.pack(0, size), SOCKET_REQUEST.pack(1, size)

        def sput(i):
            sock.sendall(put_req)
            sock.sendall(values[i])
            sock.recv(1)

        if op == "get":
            return [lambda: socket_get(sock, view, get_req) for _ in singles]
        return [lambda i=i: sput(i) for i in singles]

    def _redis_calls(self, op: str, singles, batches):
        r, rkeys, values = self._redis(), self.rkeys, self.values

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
        }[op]()


def _timed_run(worker: Worker, task: dict, barrier) -> dict:
    """Run one measure's calls after the barrier: bytes, ops, wall time and per-call latencies."""
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
    return {"bytes": n * worker.size, "ops": n, "elapsed": end - start, "latencies": lat}


def _worker_main(conn, barrier, index: int, master: str, socket_address, redis_port, transports) -> None:
    worker = Worker(index, master, socket_address, redis_port, transports)
    try:
        while True:
            task = conn.recv()
            if task is None:
                break
            try:
                if task["type"] == "prepare":
                    conn.send(worker.prepare(task["size"], task["count"], task["batch"], task["populate"]))
                    continue
                conn.send(_timed_run(worker, task, barrier))
            except Exception as exc:  # report, keep serving (a broken barrier resets in the parent)
                conn.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        for c in worker.clients.values():
            c.close()


class ClientGroup:
    """``n`` client processes started together for every measurement."""

    def __init__(self, ctx, n: int, master: str, socket_address, redis_port, transports):
        self.barrier = ctx.Barrier(n)
        self.conns, self.procs = [], []
        for i in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=run_helper,
                args=(_worker_main, child, self.barrier, i, master, socket_address, redis_port, transports),
                daemon=True,
            )
            with sigint_held():
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
