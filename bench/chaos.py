"""Chaos: a real cluster under verifying clients while nodes, the master and disks fail.

    python -m bench.chaos --seconds 60 [--clients 6] [--node-kills-per-minute 3]
        [--master-kills-per-minute 1] [--corruptions 1] [--seed 1] [--json]

Starts `kvstore master --replicas 2` and three `kvstore node` processes (small DRAM
tiers, so most blocks live on the SSD tier) on 127.0.0.1, ports chosen at run time,
in a temporary directory. ``--clients`` worker threads, each with a Client of its own
on one data path (tcp, unix, shm in turn), put, batch_put, get, get_into, batch_get,
exists, remove and match_prefix blocks whose bytes follow from (key, version): every
value carries its key hash and version in a header and the rest is a PRNG stream
seeded by both, so every read is checked. A read returns a miss or exactly some
version ever written for that key; anything else is a wrong byte.

Meanwhile, on a seeded schedule, one event at a time: kill -9 of a node (restarted on
its data directory: its SSD blocks come back), kill -9 of the master (restarted on its
port: nodes re-register and resend their inventories), corrupted SSD records (a node
is killed, bytes are flipped inside live records of its lmdb file, it is restarted
and the damaged keys are read back) and, every few seconds, a truncated PUT frame (a
raw socket sends half a frame carrying a never-written version and closes). Once, at
mid-run, the replica survival check: the workers pause, a batch of blocks is written
with replicas 2 and each second copy is confirmed, one node is killed and everything
acknowledged before is read back.

The report: ops by kind, verified reads, wrong bytes (the first few in detail),
typed errors by class, untyped exceptions (the first tracebacks), hangs (an op over
``HANG_S``), replica survival, node restart and rejoin times, master restart and
index rebuild times. The processes die with the benchmark (``die_with_parent``);
Ctrl-C stops it and still prints the report.
"""

from __future__ import annotations

import argparse
import ctypes  # noqa: F401 - loaded before any fork: die_with_parent runs between fork and exec
import json
import logging
import os
import random
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from pathlib import Path

import xxhash

from bench.common import die_with_parent, emit, markdown_table

ROOT = Path(__file__).resolve().parent.parent
HANG_S = 30.0  # an op slower than this is a hang
START_TIMEOUT_S = 60.0  # a process not serving by then failed to start
KiB, MiB = 1 << 10, 1 << 20
NAMESPACE, SURVIVAL_NAMESPACE = "chaos", "survival"
VALUE_HEAD = struct.Struct("<8sQII")  # magic, key hash, version, total size
VALUE_MAGIC = b"CHAOSv1\x00"
POISON_VERSION = 0xFFFFFFFF  # carried by truncated frames only: never written, so never readable
PATHS = ("tcp", "unix", "shm")
SAMPLES = 5  # wrong bytes / tracebacks reported in detail
OPS = {
    "put": 20,
    "batch_put": 8,
    "get": 20,
    "get_into": 12,
    "batch_get": 10,
    "exists": 8,
    "remove": 4,
    "match_prefix": 5,
    "get_other": 5,
}
MAX_VALUE = 96 * KiB


# -- values ------------------------------------------------------------------------------------
def key_for(owner: int, i: int, namespace: str = NAMESPACE) -> tuple[str, bytes]:
    return (namespace, xxhash.xxh3_128_digest(f"{namespace}:{owner}:{i}".encode()))


def key_hash(key) -> int:
    return xxhash.xxh3_64_intdigest(key[0].encode() + key[1])


def make_value(key, version: int) -> bytes:
    """The one value of (key, version): header, then a PRNG stream seeded by both."""
    seed = xxhash.xxh3_64_intdigest(key[1] + version.to_bytes(4, "little"))
    size = VALUE_HEAD.size + 512 + seed % (MAX_VALUE - VALUE_HEAD.size - 512)
    body = random.Random(seed).randbytes(size - VALUE_HEAD.size)
    return VALUE_HEAD.pack(VALUE_MAGIC, key_hash(key), version, size) + body


class Versions:
    """The highest version attempted per key (shared by every worker): a read may return
    any version from 1 to it (versions only grow, and one attempted may be stored even
    when its put failed)."""

    def __init__(self):
        self._top: dict = {}
        self._lock = threading.Lock()

    def next(self, key) -> int:
        with self._lock:
            self._top[key] = version = self._top.get(key, 0) + 1
            return version

    def top(self, key) -> int:
        with self._lock:
            return self._top.get(key, 0)


def check_value(key, data, versions: Versions) -> tuple[int | None, str | None]:
    """(version, None) when ``data`` is exactly a version ever written for ``key``; else (None, why)."""
    data = bytes(data)
    if len(data) < VALUE_HEAD.size:
        return None, f"{len(data)} bytes: shorter than the value header"
    magic, khash, version, size = VALUE_HEAD.unpack_from(data)
    if magic != VALUE_MAGIC:
        return None, f"bad value magic {magic!r}"
    if khash != key_hash(key):
        return None, f"the value of another key (key hash {khash:#x}, expected {key_hash(key):#x})"
    if not 1 <= version <= versions.top(key):
        return None, f"version {version} was never written (highest attempted {versions.top(key)})"
    expected = make_value(key, version)
    if data != expected:
        diff = next((i for i, (a, b) in enumerate(zip(data, expected)) if a != b), min(len(data), len(expected)))
        return None, f"version {version}: {len(data)} bytes (expected {len(expected)}), first difference at {diff}"
    return version, None


# -- the cluster ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Process:
    """One `kvstore` process; ``record`` is the JSON line it printed once serving."""

    def __init__(self, args: list[str], log_path: Path):
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        self.args = args
        started = time.monotonic()
        self.log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore.cli", *args, "--json"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=self.log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        ready, _, _ = select.select([self.proc.stdout], [], [], START_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            self.proc.wait()
            self.log.close()
            raise RuntimeError(f"kvstore {' '.join(args)} did not start; see {log_path}")
        self.record = json.loads(line)
        self.start_s = time.monotonic() - started  # from exec to serving

    def kill(self) -> None:
        """SIGKILL: no cleanup, like a crashed host process; then what a supervisor reaps."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
        self._reap()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reap()

    def _reap(self) -> None:
        from kvstore.tiers.arena import reap_stale_arenas

        reap_stale_arenas()
        sock = self.record.get("unix_socket")
        if sock and os.path.exists(sock):
            os.unlink(sock)
        self.proc.stdout.close()
        self.log.close()


class Cluster:
    """A master (replicas 2) and ``nodes`` nodes under ``root``; each can be killed and restarted."""

    def __init__(self, root: Path, nodes: int = 3, dram: str = "4MiB", ssd: str = "256MiB"):
        self.root = root
        self.port = free_port()
        self.master_address = f"127.0.0.1:{self.port}"
        self.node_args = ["--dram", dram, "--ssd", ssd, "--max-block", "1MiB"]
        self.master = self._start_master()
        self.nodes: list[Process | None] = [None] * nodes
        for i in range(nodes):
            self.start_node(i)

    def _start_master(self) -> Process:
        return Process(
            ["master", "--port", str(self.port), "--metrics-port", "-1", "--ttl", "3", "--replicas", "2"],
            self.root / "master.log",
        )

    def data_dir(self, i: int) -> Path:
        return self.root / f"node{i}"

    def start_node(self, i: int) -> Process:
        self.nodes[i] = Process(
            [
                "node",
                "--master",
                self.master_address,
                "--port",
                "0",
                "--metrics-port",
                "-1",
                "--data-dir",
                str(self.data_dir(i)),
                *self.node_args,
            ],
            self.root / f"node{i}.log",
        )
        return self.nodes[i]

    def kill_node(self, i: int) -> None:
        self.nodes[i].kill()

    def restart_master(self) -> Process:
        self.master = self._start_master()
        return self.master

    def close(self) -> None:
        for proc in [*self.nodes, self.master]:
            if proc is not None and proc.proc.returncode is None:
                try:
                    proc.close()
                except Exception:  # noqa: BLE001 - best effort on the way out
                    pass


# -- statistics ------------------------------------------------------------------------------------
class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.ops = Counter()
        self.typed = Counter()
        self.typed_by_op: dict = {}
        self.typed_samples: dict = {}
        self.untyped = 0
        self.untyped_samples: list = []
        self.verified = 0
        self.misses = 0
        self.wrong = 0
        self.wrong_samples: list = []
        self.hangs = 0
        self.hang_samples: list = []
        self.max_op_s = 0.0

    def op(self, kind: str, seconds: float, worker: str) -> None:
        with self.lock:
            self.ops[kind] += 1
            self.max_op_s = max(self.max_op_s, seconds)
            if seconds > HANG_S:
                self.hangs += 1
                if len(self.hang_samples) < SAMPLES:
                    self.hang_samples.append({"op": kind, "worker": worker, "seconds": round(seconds, 1)})

    def read(self, key, data, versions: Versions, op: str, path: str) -> int | None:
        """Check one read result (None: a miss); its version when verified."""
        if data is None:
            with self.lock:
                self.misses += 1
            return None
        version, why = check_value(key, data, versions)
        with self.lock:
            if why is None:
                self.verified += 1
            else:
                self.wrong += 1
                if len(self.wrong_samples) < SAMPLES:
                    self.wrong_samples.append(
                        {
                            "op": op,
                            "path": path,
                            "key": [key[0], key[1].hex()],
                            "why": why,
                            "at_s": round(time.monotonic() - START, 2),
                        }
                    )
        return version

    def error(self, exc: BaseException, op: str, path: str) -> None:
        from kvstore_client.errors import KVStoreError

        name = type(exc).__name__
        with self.lock:
            if isinstance(exc, KVStoreError):
                self.typed[name] += 1
                self.typed_by_op.setdefault(name, Counter())[f"{op}/{path}"] += 1
                self.typed_samples.setdefault(name, f"{op}/{path}: {exc}"[:300])
            else:
                self.untyped += 1
                if len(self.untyped_samples) < SAMPLES:
                    self.untyped_samples.append(
                        {
                            "op": op,
                            "path": path,
                            "at_s": round(time.monotonic() - START, 2),
                            "traceback": traceback.format_exc(),
                        }
                    )


START = time.monotonic()


# -- workers -------------------------------------------------------------------------------------
class Worker(threading.Thread):
    """One client on one data path, writing its own keys and reading everyone's."""

    def __init__(
        self,
        index: int,
        master: str,
        path: str,
        keys: int,
        clients: int,
        seed: int,
        versions: Versions,
        stats: Stats,
        control: "Control",
    ):
        super().__init__(name=f"chaos-{index}-{path}", daemon=True)
        from kvstore_client import Client

        self.index, self.path, self.clients = index, path, clients
        self.client = Client(master, data_path=path, timeout=10.0)
        self.keys = [key_for(index, i) for i in range(keys)]
        self.state: dict = {}  # key -> ("acked", version) | ("removed",) | ("unknown",)
        self.rng = random.Random(seed * 1000 + index)
        self.versions, self.stats, self.control = versions, stats, control
        self.idle = threading.Event()
        self.busy_since: float | None = None
        self.buffer = bytearray(MAX_VALUE)

    def run(self) -> None:
        kinds, weights = list(OPS), list(OPS.values())
        control = self.control
        while not control.stop.is_set():
            if control.pause.is_set():
                self.idle.set()
                while control.pause.is_set() and not control.stop.is_set():
                    time.sleep(0.02)
                self.idle.clear()
                continue
            kind = self.rng.choices(kinds, weights)[0]
            if kind == "remove" and control.no_removes.is_set():
                kind = "get"
            start = self.busy_since = time.monotonic()
            try:
                getattr(self, "_" + kind)()
            except Exception as exc:  # noqa: BLE001 - every exception is counted, typed or not
                self.stats.error(exc, kind, self.path)
            finally:
                self.busy_since = None
                self.stats.op(kind, time.monotonic() - start, self.name)
        self.idle.set()

    def _pick(self, n: int = 1) -> list:
        start = self.rng.randrange(len(self.keys))
        return [self.keys[(start + j) % len(self.keys)] for j in range(n)]

    def _put(self) -> None:
        self._write(self._pick())

    def _batch_put(self) -> None:
        self._write(self._pick(self.rng.randint(2, 6)))

    def _write(self, keys: list) -> None:
        versions = [self.versions.next(k) for k in keys]
        for k in keys:
            self.state[k] = ("unknown",)
        values = [make_value(k, v) for k, v in zip(keys, versions)]
        if len(keys) == 1:
            self.client.put(keys[0], values[0])
        else:
            self.client.batch_put(keys, values, depths=list(range(len(keys))))
        for k, v in zip(keys, versions):
            self.state[k] = ("acked", v)

    def _get(self) -> None:
        key = self._pick()[0]
        self.stats.read(key, self.client.get(key), self.versions, "get", self.path)

    def _get_other(self) -> None:
        owner = self.rng.randrange(self.clients)
        key = key_for(owner, self.rng.randrange(len(self.keys)))
        self.stats.read(key, self.client.get(key), self.versions, "get_other", self.path)

    def _get_into(self) -> None:
        key = self._pick()[0]
        n = self.client.get_into(key, self.buffer)
        self.stats.read(key, None if n is None else memoryview(self.buffer)[:n], self.versions, "get_into", self.path)

    def _batch_get(self) -> None:
        keys = self._pick(self.rng.randint(2, 8))
        for key, value in zip(keys, self.client.batch_get(keys)):
            self.stats.read(key, value, self.versions, "batch_get", self.path)

    def _exists(self) -> None:
        got = self.client.exists(self._pick()[0])
        if not isinstance(got, bool):
            raise TypeError(f"exists returned {got!r}")

    def _remove(self) -> None:
        key = self._pick()[0]
        self.state[key] = ("unknown",)
        self.client.remove(key)
        self.state[key] = ("removed",)

    def _match_prefix(self) -> None:
        keys = self._pick(self.rng.randint(1, 8))
        match = self.client.match_prefix(keys)
        if not 0 <= match.longest <= len(keys) or any(not 0 <= n <= len(keys) for n in match.per_node.values()):
            raise AssertionError(f"match_prefix of {len(keys)} keys said {match}")


class Control:
    def __init__(self):
        self.stop = threading.Event()
        self.pause = threading.Event()
        self.no_removes = threading.Event()


# -- chaos ---------------------------------------------------------------------------------------
def map_base(path: Path) -> int:
    """Where this process maps ``path`` from its first byte (Linux: /proc/self/maps)."""
    real = os.path.realpath(path)
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5] == real and int(fields[2], 16) == 0:
                return int(fields[0].split("-")[0], 16)
    raise RuntimeError(f"{path} is not mapped")


def begin_current(env, attempts: int = 10):
    """A read transaction on ``env`` at the file's current size. A node that grew its map since we
    opened the file makes lmdb refuse the begin (MDB_MAP_RESIZED); a map size of 0 adopts the new
    size, and the node may grow it again before the next try."""
    import lmdb

    for _ in range(attempts - 1):
        try:
            return env.begin(buffers=True)
        except lmdb.MapResizedError:
            env.set_mapsize(0)
    return env.begin(buffers=True)


def corrupt_live(ssd_dir: Path, rng: random.Random, records: int) -> list:
    """Flip one byte inside the payload of ``records`` records of a serving node's lmdb file; the
    keys whose records are now damaged. The records are found through an lmdb read transaction of
    our own (its address in our map of the file is its offset in the file), held open across the
    flips: lmdb reuses no page a live reader may see, so a flip lands in a record (perhaps one
    the node has replaced meanwhile), never in a page the node is writing."""
    import lmdb
    import numpy as np

    from kvstore.tiers.ssd import HEADER, decode_key, parse_header

    env = lmdb.open(str(ssd_dir), readonly=True, lock=True, subdir=True, max_readers=512)
    damaged = []
    try:
        with begin_current(env) as txn, open(ssd_dir / "data.mdb", "r+b") as f:
            base = map_base(ssd_dir / "data.mdb")  # after the begin: adopting a grown map moves it
            entries = [(bytes(k), v) for k, v in txn.cursor()]
            rng.shuffle(entries)
            for raw_key, value in entries[:records]:
                parsed = parse_header(value, raw_key)
                if parsed is None or len(value) < HEADER.size + VALUE_HEAD.size + 2:
                    continue
                start = int(np.frombuffer(value, dtype=np.uint8).ctypes.data) - base
                spot = start + HEADER.size + VALUE_HEAD.size + rng.randrange(len(value) - HEADER.size - VALUE_HEAD.size)
                f.seek(spot)
                byte = f.read(1)[0]
                f.seek(spot)
                f.write(bytes([byte ^ 0x5A]))
                f.flush()
                if xxhash.xxh3_64_intdigest(value[HEADER.size :]) != parsed[2]:  # our map shows the flip
                    damaged.append(decode_key(raw_key))
    finally:
        env.close()
    return damaged


def corrupt_ssd(ssd_dir: Path, rng: random.Random, records: int) -> list:
    """Flip one byte inside the payload of up to ``records`` live records of a (stopped) node's
    lmdb file; the keys (namespace, digest) whose records are now damaged."""
    import lmdb

    from kvstore.tiers.ssd import HEADER, MAGIC, decode_key, parse_header

    path = ssd_dir / "data.mdb"
    data = bytearray(path.read_bytes())
    offsets = []
    at = data.find(MAGIC)
    while at >= 0:
        if (
            at + HEADER.size + VALUE_HEAD.size <= len(data)
            and data[at + HEADER.size : at + HEADER.size + 8] == VALUE_MAGIC
        ):
            offsets.append(at)
        at = data.find(MAGIC, at + 1)
    rng.shuffle(offsets)
    with open(path, "r+b") as f:
        for at in offsets[: records * 4]:  # some are stale copies in free pages: flip more, count the live
            size = HEADER.unpack_from(data, at)[3]
            spot = at + HEADER.size + VALUE_HEAD.size + rng.randrange(max(1, min(size, len(data) - at) - 64))
            if spot < len(data):
                f.seek(spot)
                f.write(bytes([data[spot] ^ 0x5A]))
    damaged = []
    env = lmdb.open(str(ssd_dir), readonly=True, lock=False, subdir=True)
    try:
        with env.begin(buffers=True) as txn:
            for raw_key, value in txn.cursor():
                parsed = parse_header(value, raw_key)
                if parsed is not None and xxhash.xxh3_64_intdigest(value[HEADER.size :]) != parsed[2]:
                    damaged.append(decode_key(raw_key))
    finally:
        env.close()
    return damaged


def truncated_put(address: str, key, rng: random.Random, unix: str | None = None) -> None:
    """Half a PUT frame of a never-written version of ``key``, then close."""
    from kvstore_client.wire import Op, pack_header, put_entry

    value = make_value(key, 1)
    value = VALUE_HEAD.pack(VALUE_MAGIC, key_hash(key), POISON_VERSION, len(value)) + value[VALUE_HEAD.size :]
    table = put_entry(key, 0, len(value), xxhash.xxh3_64_intdigest(value))
    frame = pack_header(Op.PUT, 1, 1, len(table) + len(value)) + table + value
    cut = rng.randrange(8, len(frame) - 1)
    if unix:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(5)
        sock.connect(unix)
    else:
        host, port = address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=5)
    with sock:
        sock.sendall(frame[:cut])


class Chaos:
    def __init__(self, cluster: Cluster, args, versions: Versions, stats: Stats, control: Control, workers: list):
        from kvstore_client import Client

        self.cluster, self.args, self.versions, self.stats = cluster, args, versions, stats
        self.control, self.workers = control, workers
        self.rng = random.Random(args.seed)
        self.admin = Client(cluster.master_address, data_path="tcp", timeout=5.0)
        self.events: list = []
        self.node_restart_s: list = []
        self.node_rejoin_s: list = []
        self.master_restart_s: list = []
        self.index_rebuild_s: list = []
        self.index_keys: list = []
        self.node_kills = self.master_kills = self.truncated = 0
        self.corruptions: dict = {
            "events": 0,
            "records_damaged": 0,
            "live_records_damaged": 0,
            "offline_records_damaged": 0,
            "read_back": Counter(),
        }
        self.survival: dict = {}
        self.errors: list = []

    # schedule ----------------------------------------------------------------------------------
    def schedule(self) -> list:
        seconds = self.args.seconds
        minutes = seconds / 60
        kinds = (
            ["node_kill"]
            * max(1 if self.args.node_kills_per_minute > 0 else 0, round(self.args.node_kills_per_minute * minutes))
            + ["master_kill"]
            * max(1 if self.args.master_kills_per_minute > 0 else 0, round(self.args.master_kills_per_minute * minutes))
            + ["corrupt"] * self.args.corruptions
        )
        self.rng.shuffle(kinds)
        kinds.insert(len(kinds) // 2, "survival")
        # spread over [10%, 85%] of the run, one slot each, jittered inside its slot
        span0, span1 = 0.10 * seconds, 0.85 * seconds
        slot = (span1 - span0) / len(kinds)
        return [(span0 + slot * (i + 0.25 * self.rng.random()), kind) for i, kind in enumerate(kinds)]

    def run(self, deadline: float) -> None:
        plan = self.schedule()
        next_truncated = 2.0
        for at, kind in plan:
            while time.monotonic() - START < at:
                if self.control.stop.wait(0.1):
                    return
                if time.monotonic() - START >= next_truncated:
                    self._truncated_frame()
                    next_truncated = time.monotonic() - START + 2.0
            if time.monotonic() > deadline or self.control.stop.is_set():
                return
            try:
                getattr(self, "_" + kind)()
                self.events.append({"at_s": round(at, 1), "event": kind})
            except Exception:  # noqa: BLE001 - a chaos step that failed is reported, not fatal
                self.errors.append({"event": kind, "traceback": traceback.format_exc()})
                self._heal()
        while not self.control.stop.wait(0.1) and time.monotonic() < deadline:
            if time.monotonic() - START >= next_truncated:
                self._truncated_frame()
                next_truncated = time.monotonic() - START + 2.0

    # steps -----------------------------------------------------------------------------------
    def _heal(self) -> None:
        """After a failed step: every process serving again."""
        if self.cluster.master.proc.poll() is not None:
            self.cluster.master.kill()
            self.cluster.restart_master()
        for i, node in enumerate(self.cluster.nodes):
            if node.proc.poll() is not None:
                node.kill()
                self.cluster.start_node(i)
        self.control.pause.clear()
        self.control.no_removes.clear()

    def _alive(self) -> dict:
        try:
            return {n.info.node_id: n for n in self.admin.cluster_status().nodes if n.alive}
        except Exception:  # noqa: BLE001 - the master may be down
            return {}

    def _wait_all_alive(self, timeout: float = 30.0) -> float:
        start = time.monotonic()
        ids = {n.record["node_id"] for n in self.cluster.nodes}
        while time.monotonic() - start < timeout:
            if ids <= set(self._alive()):
                return time.monotonic() - start
            time.sleep(0.05)
        raise TimeoutError(f"nodes not all alive after {timeout}s")

    def _restart_node(self, i: int) -> None:
        started = time.monotonic()
        proc = self.cluster.start_node(i)
        self.node_restart_s.append(round(proc.start_s, 3))
        self._wait_all_alive()
        self.node_rejoin_s.append(round(time.monotonic() - started, 3))

    def _node_kill(self) -> None:
        i = self.rng.randrange(len(self.cluster.nodes))
        self.cluster.kill_node(i)
        self.node_kills += 1
        time.sleep(1.0 + self.rng.random())  # clients meet the dead node meanwhile
        self._restart_node(i)

    def _master_kill(self) -> None:
        self.control.no_removes.set()  # the index may only grow meanwhile: "what it held before" is then exact
        time.sleep(0.2)
        before = self.admin.cluster_status().indexed_keys
        self.cluster.master.kill()
        self.master_kills += 1
        time.sleep(0.5 + self.rng.random())
        started = time.monotonic()
        proc = self.cluster.restart_master()
        self.master_restart_s.append(round(proc.start_s, 3))
        self.index_keys.append(before)
        rebuilt = None
        while time.monotonic() - started < 30:
            try:
                if self.admin.cluster_status().indexed_keys >= before:
                    rebuilt = time.monotonic() - started
                    break
            except Exception:  # noqa: BLE001 - not serving yet
                pass
            time.sleep(0.02)
        self.index_rebuild_s.append(None if rebuilt is None else round(rebuilt, 3))
        self._wait_all_alive()
        self.control.no_removes.clear()

    def _corrupt(self) -> None:
        """Odd events flip bytes in a serving node's SSD file; even ones kill the node, flip
        bytes in its file and restart it on it. Then every damaged key is read back."""
        from kvstore_client import Client
        from kvstore_client.errors import KVStoreError

        i = self.rng.randrange(len(self.cluster.nodes))
        self.corruptions["events"] += 1
        if self.corruptions["events"] % 2:
            damaged = corrupt_live(self.cluster.data_dir(i) / "ssd", self.rng, records=8)
            self.corruptions["live_records_damaged"] += len(damaged)
        else:
            self.cluster.kill_node(i)
            damaged = corrupt_ssd(self.cluster.data_dir(i) / "ssd", self.rng, records=8)
            self.corruptions["offline_records_damaged"] += len(damaged)
            self._restart_node(i)
        self.corruptions["records_damaged"] += len(damaged)
        for path in PATHS:  # read every damaged key back, one client per data path
            with Client(self.cluster.master_address, data_path=path) as client:
                for key in damaged:
                    try:
                        value = client.get(key)
                    except KVStoreError as exc:
                        self.corruptions["read_back"][type(exc).__name__] += 1
                        continue
                    version = self.stats.read(key, value, self.versions, "get_corrupted", path)
                    self.corruptions["read_back"][
                        "miss" if value is None else "verified" if version is not None else "WRONG"
                    ] += 1

    def _truncated_frame(self) -> None:
        nodes = [n for n in self.cluster.nodes if n.proc.poll() is None]
        if not nodes:
            return
        node = self.rng.choice(nodes)
        key = key_for(self.rng.randrange(self.args.clients), self.rng.randrange(self.args.keys))
        try:
            truncated_put(
                node.record["data"],
                key,
                self.rng,
                unix=node.record.get("unix_socket") if self.rng.random() < 0.5 else None,
            )
            self.truncated += 1
        except OSError:
            pass  # the node was just killed

    def _pause_workers(self) -> None:
        self.control.pause.set()
        deadline = time.monotonic() + HANG_S
        for w in self.workers:
            w.idle.wait(max(0.0, deadline - time.monotonic()))

    def _survival(self) -> None:
        """Pause the workers, write blocks with replicas 2 and confirm both copies, kill one
        node, read back everything acknowledged before."""
        from kvstore_client import Client

        self._pause_workers()
        try:
            self._wait_all_alive()
            writer = Client(self.cluster.master_address, data_path="tcp", replicas=2)
            keys = [key_for(0, i, SURVIVAL_NAMESPACE) for i in range(120)]
            acked, two = [], 0
            for j in range(0, len(keys), 4):
                batch = keys[j : j + 4]
                versions = [self.versions.next(k) for k in batch]
                writer.batch_put(batch, [make_value(k, v) for k, v in zip(batch, versions)])
                acked += batch
                two += sum(len(r or ()) >= 2 for r in writer._locations.lookup(batch))  # copies the SDK stored
            writer.close()
            indexed = 0
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # the master's index names both copies of each
                located = self.admin._locate(acked, use_cache=False)
                indexed = sum(len(r) >= 2 for r in located)
                if indexed == len(acked):
                    break
                time.sleep(0.1)
            workload = {k: s[1] for w in self.workers for k, s in w.state.items() if s[0] == "acked"}
            # an overwrite lands on the nodes placed then, and copies of older versions elsewhere stay:
            # keys the index names on more nodes than the replication factor hold such copies
            spread = sum(len(r) > 2 for r in self.admin._locate(list(workload), use_cache=False))
            victim = self.rng.randrange(len(self.cluster.nodes))
            self.cluster.kill_node(victim)
            self.node_kills += 1
            readable = readable_workload = stale = 0
            with Client(self.cluster.master_address, data_path="tcp") as reader:
                for k in acked:
                    readable += self.stats.read(k, reader.get(k), self.versions, "survival", "tcp") is not None
                for k, version in workload.items():
                    got = self.stats.read(k, reader.get(k), self.versions, "survival_workload", "tcp")
                    readable_workload += got is not None
                    stale += got is not None and got < version
            self.survival = {
                "written": len(acked),
                "both_copies_acknowledged": two,
                "both_copies_indexed": indexed,
                "readable_after_kill": readable,
                "fraction": round(readable / len(acked), 4),
                "workload_acknowledged": len(workload),
                "workload_readable": readable_workload,
                "workload_fraction": round(readable_workload / max(1, len(workload)), 4),
                "workload_stale_versions": stale,
                "workload_keys_on_more_than_2_nodes": spread,
            }
            self._restart_node(victim)
        finally:
            self.control.pause.clear()


# -- the run -------------------------------------------------------------------------------------
def run(args) -> dict:
    global START
    root = Path(tempfile.mkdtemp(prefix="kvstore-chaos-"))
    versions, stats, control = Versions(), Stats(), Control()
    cluster = chaos = None
    workers: list = []
    interrupted = False
    START = time.monotonic()
    try:
        cluster = Cluster(root)
        workers = [
            Worker(
                i,
                cluster.master_address,
                PATHS[i % len(PATHS)],
                args.keys,
                args.clients,
                args.seed,
                versions,
                stats,
                control,
            )
            for i in range(args.clients)
        ]
        chaos = Chaos(cluster, args, versions, stats, control, workers)
        START = time.monotonic()
        deadline = START + args.seconds
        for w in workers:
            w.start()
        chaos_thread = threading.Thread(target=chaos.run, args=(deadline,), daemon=True)
        chaos_thread.start()
        while time.monotonic() < deadline and chaos_thread.is_alive():
            time.sleep(0.2)
        chaos_thread.join()  # let a step in progress finish
    except KeyboardInterrupt:
        interrupted = True
    finally:
        control.stop.set()
        elapsed = time.monotonic() - START
        stuck = []
        join_by = time.monotonic() + HANG_S + 5
        for w in workers:
            w.join(timeout=max(0.0, join_by - time.monotonic()))
            since = w.busy_since
            if w.is_alive() and since is not None:
                stuck.append({"worker": w.name, "in_op_for_s": round(time.monotonic() - since, 1)})
        for w in workers:
            if not w.is_alive():
                w.client.close()
        if chaos is not None:
            chaos.admin.close()
        if cluster is not None:
            cluster.close()
        logs = {p.name: p.read_text(errors="replace")[-2000:] for p in root.glob("*.log")}
        shutil.rmtree(root, ignore_errors=True)
    return report(args, elapsed, stats, chaos, stuck, interrupted, logs)


def report(args, elapsed, stats: Stats, chaos: Chaos | None, stuck: list, interrupted: bool, logs: dict) -> dict:
    out = {
        "seconds": round(elapsed, 1),
        "clients": args.clients,
        "paths": [PATHS[i % len(PATHS)] for i in range(args.clients)],
        "seed": args.seed,
        "interrupted": interrupted,
        "hang_bound_s": HANG_S,
        "ops": dict(stats.ops),
        "ops_total": sum(stats.ops.values()),
        "verified_reads": stats.verified,
        "misses": stats.misses,
        "wrong_bytes": stats.wrong,
        "wrong_byte_samples": stats.wrong_samples,
        "typed_errors": dict(stats.typed),
        "typed_errors_by_op": {k: dict(v) for k, v in stats.typed_by_op.items()},
        "typed_error_samples": stats.typed_samples,
        "untyped_exceptions": stats.untyped,
        "untyped_samples": stats.untyped_samples,
        "hangs": stats.hangs + len(stuck),
        "hang_samples": stats.hang_samples + stuck,
        "max_op_s": round(stats.max_op_s, 3),
    }
    if chaos is not None:
        out.update(
            {
                "node_kills": chaos.node_kills,
                "master_kills": chaos.master_kills,
                "truncated_frames": chaos.truncated,
                "corruptions": {**chaos.corruptions, "read_back": dict(chaos.corruptions["read_back"])},
                "replica_survival": chaos.survival,
                "node_restart_s": chaos.node_restart_s,
                "node_rejoin_s": chaos.node_rejoin_s,
                "master_restart_s": chaos.master_restart_s,
                "index_rebuild_s": chaos.index_rebuild_s,
                "indexed_keys_before_master_kill": chaos.index_keys,
                "events": chaos.events,
                "chaos_step_errors": chaos.errors,
            }
        )
    if stats.wrong or stats.untyped or out["hangs"] or (chaos and chaos.errors):
        out["process_logs"] = logs
    return out


def table(r: dict) -> str:
    surv = r.get("replica_survival") or {}
    rows = [
        ["ops", f"{r['ops_total']} ({', '.join(f'{k} {v}' for k, v in sorted(r['ops'].items()))})"],
        ["verified reads / misses", f"{r['verified_reads']} / {r['misses']}"],
        ["WRONG BYTES", r["wrong_bytes"]],
        ["typed errors", ", ".join(f"{k} {v}" for k, v in sorted(r["typed_errors"].items())) or "none"],
        ["untyped exceptions", r["untyped_exceptions"]],
        [f"hangs (> {r['hang_bound_s']:.0f} s)", f"{r['hangs']} (slowest op {r['max_op_s']} s)"],
        ["node kills / master kills", f"{r.get('node_kills')} / {r.get('master_kills')}"],
        ["truncated frames", r.get("truncated_frames")],
        [
            "corrupted SSD records (read back)",
            f"{r.get('corruptions', {}).get('records_damaged')} ({r.get('corruptions', {}).get('read_back')})",
        ],
        [
            "replica survival (one node killed)",
            f"{surv.get('readable_after_kill')}/{surv.get('written')} = {surv.get('fraction')}"
            f" (both copies acknowledged {surv.get('both_copies_acknowledged')}, indexed "
            f"{surv.get('both_copies_indexed')}); workload {surv.get('workload_readable')}/"
            f"{surv.get('workload_acknowledged')}",
        ],
        ["node restart / rejoin s", f"{r.get('node_restart_s')} / {r.get('node_rejoin_s')}"],
        ["master restart / index rebuild s", f"{r.get('master_restart_s')} / {r.get('index_rebuild_s')}"],
    ]
    text = markdown_table(["what", "figure"], rows)
    if r["interrupted"]:
        text = f"interrupted after {r['seconds']} s\n" + text
    for sample in r["wrong_byte_samples"]:
        text += f"\nWRONG BYTES: {sample}"
    for sample in r["untyped_samples"]:
        text += f"\nUNTYPED in {sample['op']}/{sample['path']}:\n{sample['traceback']}"
    for err in r.get("chaos_step_errors", []):
        text += f"\nchaos step {err['event']} failed:\n{err['traceback']}"
    return text


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--clients", type=int, default=6, help="worker threads, tcp/unix/shm in turn")
    parser.add_argument("--keys", type=int, default=150, help="keys each client writes")
    parser.add_argument("--node-kills-per-minute", type=float, default=3)
    parser.add_argument("--master-kills-per-minute", type=float, default=1)
    parser.add_argument(
        "--corruptions",
        type=int,
        default=2,
        help="SSD corruption events in the run (a serving node's file, then a stopped node's, in turn)",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # before gRPC loads: no fork() notes from its core
    logging.basicConfig(level=logging.ERROR)  # the SDK warns of every dead replica: counted in the report instead
    result = run(args)
    emit(result, args.json, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
