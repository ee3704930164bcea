"""Structure-aware fuzzing of a live node's data plane, the master's gRPC services and its conductor port.

    python -m bench.fuzz [--frames N] [--seconds S] [--seed K] [--senders P] [--grpc-in-flight G] [--json]

Starts a master and two storage nodes as processes of their own (one plain, one with an
access file: ``--auth``), then, until ``--frames`` frames were sent or ``--seconds`` passed:

- ``--senders`` processes open data-plane connections (TCP to both nodes, the plain node's
  Unix socket, where the same-host ops are served) and pipeline batches of frames of every
  op in ``Op`` (``KEYED_OPS`` and ``KEYLESS_OPS`` enumerated, so a new op is fuzzed without
  an edit here) and of undefined op codes. Frames are well-formed with random fields (keys
  at and past the limits: empty, 128/129-byte namespaces, NULs, bad UTF-8, 64/65-byte
  digests; tiny and oversized values; right and wrong checksums; plausible and random lease,
  reservation and grant ids; every flag), and a batch usually ends in one hostile frame: a
  header with a mutated magic, version, op, count, body_len, flags or status; a table whose
  lengths run past it or past ``max_table_bytes``; a body cut short; random bytes; a flipped
  bit. On the node with the access file most connections authenticate first (AUTH hello and
  proof with an admin token) and the rest send fuzzed AUTH frames and requests before AUTH.
  Each connection's write side is shut after its batch and every reply is read to EOF.
- one process calls every method of every gRPC service in the proto descriptors (enumerated)
  with random messages of its input type, mutated serializations of them and raw garbage, as
  raw bytes through a generic channel call (``--grpc-in-flight`` at a time, default 8; on a
  small machine the master's gRPC stack takes the CPU the data plane's frames would get).
- one process fuzzes the master's conductor port (framed TCP, ``proto/conductor.md``; its
  address from the master's start line). It registers a prefill and a decode engine over
  gRPC so that some Schedules are placed, then opens connections of pipelined frames with
  valid headers (Schedule and ReportRequest bodies: plausible, random, mutated, garbage,
  empty; AUTH with random tokens), now and then a long burst, most ending in a hostile frame
  (bad magic or version, an unknown method, a size over ``MAX_BODY_BYTES``, an AUTH over
  4096 bytes, a frame cut short, garbage, a flipped bit). Each reply must be a well-formed
  frame answering its request in order (its request_id, a body that decodes), nothing may
  follow BAD_FRAME / UNAUTHENTICATED / BUSY, and a header the port must refuse gets
  BAD_FRAME; anything else is a malformed reply. Some connections are closed right after
  sending, a few are left open mid-frame, and once the port is filled past its connection
  limit (the extra ones must get BUSY). At the end a fresh connection's AUTH and Schedule
  must still be answered (the probe).
- a well-behaved client (the SDK's TcpConnection/UnixConnection, one of each per node kind)
  keeps putting random values and reading them back on its own connections, and reads the
  master's ClusterStatus; any error or wrong value is a failure.

The master and nodes' RSS (and its anonymous / file / shared split), open fds and threads
are sampled every second. Reported: frames sent and frames/s, replies, ops covered,
connection resets, stalled connections, gRPC calls and their status codes per method, the
good client's operations and failures, the conductor port's frames, connections and reply
statuses (all, and per method), crashes (a process that died), tracebacks in the
processes' stderr, and RSS/fds at start, peak and end. ``ok`` is true when nothing crashed,
no traceback was logged, the good client never failed, no connection stalled (data plane or
conductor port), the conductor port sent no malformed reply and passed its probe, anonymous RSS
grew by less than ``RSS_BOUND`` per process and the fds came back to within ``FD_BOUND`` of
where they started. Exit status 1 when not ok.

The good client uses direct data-plane connections, not ``Client(master)``: the master is
fuzzed without an access file, so random Register calls add nodes that do not exist, and
the placement of a Client's puts may then pick one (that is what --auth is for).
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import random
import selectors
import socket
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.cluster import (
    ADMIN_TOKEN,
    proc_sample,
    reap_arenas,
    start_master,
    start_node,
    write_access_file,
)

MiB = 1 << 20
RSS_BOUND = 256 * MiB  # anonymous RSS growth allowed per process, start to end
FD_BOUND = 32  # open fds allowed above the start once the fuzzing connections closed
NODE_DRAM, NODE_SSD, NODE_MAX_BLOCK = "128MiB", "64MiB", "1MiB"
MAX_BLOCK = 1 * MiB
MAX_TABLE = 4 * MiB  # the nodes' default --max-table
EXCHANGE_TIMEOUT = 30.0  # a connection not finished by then is a stall


# -- frames ----------------------------------------------------------------------------------
def _wire():
    from kvstore_client import wire

    return wire


class FrameGen:
    """Random frames of every op; ``batch()`` is one connection's bytes. Knows only the codec's
    tables (Op, KEYED_OPS, KEYLESS_OPS and the entry layouts), so new ops are covered."""

    POOL = 4096

    def __init__(self, rng: random.Random, same_host: bool, auth: bool, pull_sources: list[str]):
        w = self.w = _wire()
        self.rng = rng
        self.same_host = same_host
        self.pull_sources = [s.encode() for s in pull_sources]
        self.keyed = dict(w.KEYED_OPS)
        self.keyless = sorted(w.KEYLESS_OPS)
        self.defined = sorted(set(self.keyed) | set(self.keyless))
        same_host_ops = {w.Op.RESERVE, w.Op.COMMIT, w.Op.STORE, w.Op.LEASE}
        # Ops that end a connection even when well-formed: ids this connection may never
        # have issued (RELEASE, COMMIT, STORE: UNKNOWN_LEASE), AUTH on a node with an access
        # file (again, or before), the same-host ops over TCP (SAME_HOST_ONLY). The rest are
        # "benign": a connection's frames are mostly those, so most frames are served, and
        # the risky ones and a hostile frame come last.
        risky = {w.Op.RELEASE, w.Op.COMMIT, w.Op.STORE} | (set() if same_host else same_host_ops)
        if auth:
            risky.add(w.Op.AUTH)
        self.risky = sorted(op for op in self.defined if op in risky)
        self.benign = [op for op in self.defined if op not in risky]
        self.unknown_ops = [op for op in range(256) if op not in self.defined and op != w.Op.ERROR] + [w.Op.ERROR]
        self.flags = [getattr(w, name) for name in dir(w) if name.startswith("FLAG_")]
        self.sent = collections.Counter()  # op name -> frames
        self.mutations = collections.Counter()
        self._ids = [1, 2, 3, 4, 5, 0, 2**64 - 1, 2**32]
        self._pool: list[tuple[int, bytes]] = []

    # keys
    def key(self) -> tuple[bytes, bytes]:
        r = self.rng.random()
        if r < 0.75:
            ns = self.rng.choice((b"fuzz", b"f", b"fuzz-a", b"fuzz-b"))
            dg = self.rng.randbytes(self.rng.choice((16, 16, 32, 8)))
            if self.rng.random() < 0.5:  # a small key space: puts and gets meet
                dg = self.rng.randrange(64).to_bytes(16, "little")
            return ns, dg
        ns = self.rng.choice(
            (b"", b"x" * 128, b"x" * 129, b"x" * 255, b"a\0b", b"\xff\xfe", "\u00e9\u6f22".encode(), b"fuzz")
        )
        dg = self.rng.randbytes(self.rng.choice((0, 1, 64, 65, 255)))
        return ns, dg

    def _fields(self, fixed: struct.Struct) -> list[int]:
        """Random values for the fields after ns_len, dg_len of a table layout."""
        out = []
        for code in fixed.format.lstrip("<>=!@")[2:]:
            bits = struct.calcsize(code) * 8
            r = self.rng.random()
            out.append(self.rng.randrange(4096) if r < 0.8 else self.rng.choice((0, 1, 2**bits - 1, 2 ** (bits - 1))))
        return out

    def entry(self, fixed: struct.Struct, ns: bytes, dg: bytes, fields: list[int]) -> bytes:
        return fixed.pack(len(ns), len(dg), *fields) + ns + dg

    def table(self, fixed: struct.Struct, n: int) -> bytes:
        return b"".join(self.entry(fixed, *self.key(), self._fields(fixed)) for _ in range(n))

    def count(self) -> int:
        r = self.rng.random()
        if r < 0.7:
            return self.rng.randint(1, 4)
        if r < 0.98:
            return self.rng.randint(0, 16)
        return self.rng.choice((0, 100, 1000))

    def value_size(self, n: int) -> int:
        r = self.rng.random()
        if r < 0.95:
            return self.rng.randint(1, 512)
        if r < 0.998 or n > 1:
            return self.rng.choice((0, 1, 4096))
        return self.rng.choice((65536, MAX_BLOCK, MAX_BLOCK + 1))

    def put_body(self, n: int, flags: int, store: bool) -> tuple[bytes, int]:
        w = self.w
        checksums_last = bool(flags & w.FLAG_CHECKSUMS_LAST) and not store
        entries, payloads, trailer = [], [], []
        for _ in range(n):
            ns, dg = self.key()
            size = self.value_size(n)
            if store:
                entries.append(
                    w.PUT_ENTRY.pack(len(ns), len(dg), self.rng.randrange(8), size, self.rng.getrandbits(64)) + ns + dg
                )
                continue
            payload = self.rng.randbytes(size) if size <= 4096 else bytes(size)
            checksum = w_checksum(payload) if self.rng.random() < 0.8 else self.rng.getrandbits(64)
            entries.append(
                w.PUT_ENTRY.pack(len(ns), len(dg), self.rng.randrange(8), size, 0 if checksums_last else checksum)
                + ns
                + dg
            )
            payloads.append(payload)
            trailer.append(w.U64.pack(checksum))
        body = b"".join(entries) + b"".join(payloads) + (b"".join(trailer) if checksums_last else b"")
        if store:
            body = w.U64.pack(self.rng.choice(self._ids)) + body
        return body, n

    def pick(self, benign: bool) -> int:
        """A random op: with ``benign``, one this connection serves without a frame-level error
        when its fields are well-formed; else any op, undefined ones included."""
        rng = self.rng
        if benign:
            return rng.choice(self.benign)
        r = rng.random()
        if r < 0.25:
            return rng.choice(self.unknown_ops)
        if r < 0.7:
            return rng.choice(self.risky)
        return rng.choice(self.defined)

    def frame(self, op: int | None = None, benign: bool = True) -> bytes:
        """One well-formed frame (its fields random) of ``op`` (default: a random op)."""
        w, rng = self.w, self.rng
        if op is None:
            op = self.pick(benign)
        flags = 0
        for flag in self.flags:
            if flag != w.FLAG_REPLY and rng.random() < 0.15:
                flags |= flag
        if op == w.Op.PULL:
            n = self.count()
            source = rng.choice(self.pull_sources + [b"127.0.0.1:1", b"[::1]:1", b"\xff:x", b"9" * 255])
            body = bytes([len(source)]) + source + self.table(w.PULL_ENTRY, n)
        elif op in (w.Op.PUT, w.Op.STORE):
            body, n = self.put_body(self.count() if rng.random() < 0.3 else 1, flags, op == w.Op.STORE)
        elif op in self.keyed:
            n = self.count()
            body = self.table(self.keyed[op], n)
        elif op == w.Op.RELEASE:
            n = self.count()
            body = b"".join(w.U64.pack(rng.choice(self._ids)) for _ in range(n))
        elif op == w.Op.COMMIT:
            n = self.count()
            body = w.U64.pack(rng.choice(self._ids)) + b"".join(w.U64.pack(rng.getrandbits(64)) for _ in range(n))
        elif op == w.Op.AUTH:
            n = 0
            body = rng.randbytes(32 if benign else rng.choice((32, 0, 31, 33, 64)))
        else:  # PING, INFO, a keyless op added later, an unknown op: random count and body
            n = 0 if rng.random() < 0.9 else rng.randrange(5)
            body = rng.randbytes(rng.choice((0, 0, 0, 8, 64)))
        self.sent[_op_name(op)] += 1
        return w.pack_header(op, rng.getrandbits(32), n, len(body), flags=flags) + body

    def hostile(self) -> tuple[bytes, str]:
        """A frame with one thing wrong, and what: usually the last of a connection's frames."""
        w, rng = self.w, self.rng
        frame = bytearray(self.frame(benign=rng.random() < 0.5))
        head = w.HEADER
        magic, version, op, status, flags, rid, count, body_len = head.unpack_from(frame)
        kind = rng.choice(
            (
                "magic",
                "version",
                "op",
                "count",
                "count_off",
                "body_len_huge",
                "body_len_short",
                "body_len_long",
                "truncated",
                "table_lies",
                "table_too_large",
                "flags",
                "status",
                "garbage",
                "bitflip",
                "short_header",
            )
        )
        if kind == "magic":
            magic = rng.choice((b"VK", b"\0\0", b"kv", rng.randbytes(2)))
        elif kind == "version":
            version = rng.choice((0, 2, 255))
        elif kind == "op":
            op = rng.choice(self.unknown_ops)
        elif kind == "count":
            count = rng.choice((w.MAX_ITEMS, w.MAX_ITEMS + 1, 2**32 - 1, 2**31))
        elif kind == "count_off":
            count = max(0, count + rng.choice((-1, 1, 2)))
        elif kind == "body_len_huge":
            body_len = rng.choice((2**64 - 1, 2**40, 64 * MiB + 1, 2**32))
        elif kind == "body_len_short":
            body_len = rng.randrange(body_len) if body_len else 0
        elif kind == "body_len_long":
            body_len += rng.choice((1, 8, 4096))
        elif kind == "truncated":
            cut = rng.randrange(1, len(frame)) if len(frame) > 1 else 1
            self.mutations[kind] += 1
            return bytes(frame[:cut]), kind
        elif kind == "table_lies":
            fixed = self.keyed.get(w.Op.GET)
            entries = [self.entry(fixed, *self.key(), []) for _ in range(rng.randint(1, 4))]
            lie = bytearray(entries[-1])
            lie[rng.randrange(2)] = rng.choice((255, 200, min(len(lie), 255)))
            entries[-1] = bytes(lie)
            body = b"".join(entries)
            op = rng.choice(list(self.keyed))
            frame = bytearray(w.pack_header(op, rid, len(entries), len(body)) + body)
            count, body_len, flags, status = len(entries), len(body), 0, 0
        elif kind == "table_too_large":
            op = rng.choice([o for o in self.keyed if o not in (w.Op.PUT, w.Op.PULL, w.Op.STORE)])
            body_len = rng.choice((MAX_TABLE + 1, 8 * MiB, 63 * MiB))
            count = rng.choice((1, 1000, w.MAX_ITEMS))
            frame = bytearray(w.pack_header(op, rid, count, body_len)) + self.table(self.keyed[op], 4)
            flags = status = 0
        elif kind == "flags":
            flags = rng.getrandbits(16)
        elif kind == "status":
            status = rng.randrange(1, 2**16)
        elif kind == "garbage":
            self.mutations[kind] += 1
            return rng.randbytes(rng.choice((1, 23, 24, 25, 100, 4096))), kind
        elif kind == "bitflip":
            i = rng.randrange(len(frame))
            frame[i] ^= 1 << rng.randrange(8)
            self.mutations[kind] += 1
            return bytes(frame), kind
        elif kind == "short_header":
            self.mutations[kind] += 1
            return bytes(frame[: rng.randrange(1, head.size)]), kind
        head.pack_into(frame, 0, magic, version, op, status, flags, rid, count, body_len & (2**64 - 1))
        self.mutations[kind] += 1
        return bytes(frame), kind

    def benign_frame(self) -> bytes:
        """A benign frame from a pool of ``POOL`` generated ones, a twentieth of them replaced
        by fresh ones as they are drawn (frames depend on no connection state, so a pool keeps
        the variety while the senders spend their time sending, not generating)."""
        rng, pool = self.rng, self._pool
        if len(pool) < self.POOL:
            op = self.pick(True)
            pool.append((op, self.frame(op)))
            return pool[-1][1]
        i = rng.randrange(self.POOL)
        if rng.random() < 0.05:
            op = self.pick(True)
            pool[i] = (op, self.frame(op))
            return pool[i][1]
        op, frame = pool[i]
        self.sent[_op_name(op)] += 1
        return frame

    def batch(self) -> tuple[bytes, int]:
        """One connection's bytes: a pipelined mix of frames, usually closed by a hostile one."""
        n = min(int(self.rng.expovariate(1 / 200)) + 1, 2000)
        frames = [self.benign_frame() for _ in range(n)]
        for _ in range(self.rng.choice((0, 0, 1, 1, 2))):
            frames.append(self.frame(benign=False))
            n += 1
        if self.rng.random() < 0.7:
            frames.append(self.hostile()[0])
            n += 1
        return b"".join(frames), n


def w_checksum(data: bytes) -> int:
    import xxhash

    return xxhash.xxh3_64_intdigest(data)


def _op_name(op: int) -> str:
    w = _wire()
    try:
        return w.Op(op).name
    except ValueError:
        return "UNKNOWN"


# -- the senders (processes of their own) ----------------------------------------------------
def _connect(target: tuple) -> socket.socket:
    kind, where = target[0], target[1]
    if kind == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect(where)
        return sock
    host, port = where.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _recv_frame(sock: socket.socket) -> tuple[int, int, bytes]:
    w = _wire()
    head = b""
    while len(head) < w.HEADER_SIZE:
        chunk = sock.recv(w.HEADER_SIZE - len(head))
        if not chunk:
            raise EOFError
        head += chunk
    _, _, op, status, _, _, _, body_len = w.HEADER.unpack(head)
    body = b""
    while len(body) < body_len:
        chunk = sock.recv(body_len - len(body))
        if not chunk:
            raise EOFError
        body += chunk
    return op, status, body


def _authenticate(sock: socket.socket, rng: random.Random) -> bool:
    """The AUTH exchange with the admin token over a raw socket; whether it was accepted."""
    from kvstore_client.auth import HELLO_BYTES, PROOF_BYTES, DataKey, Handshake

    w = _wire()
    handshake = Handshake(DataKey.of_token(ADMIN_TOKEN))
    sock.sendall(w.pack_header(w.Op.AUTH, 1, 0, HELLO_BYTES) + handshake.hello())
    op, status, body = _recv_frame(sock)
    if op != w.Op.AUTH or status:
        return False
    sock.sendall(w.pack_header(w.Op.AUTH, 2, 0, PROOF_BYTES) + handshake.challenge(body))
    op, status, body = _recv_frame(sock)
    return op == w.Op.AUTH and not status


def _exchange(sock: socket.socket, data: bytes, timeout: float) -> tuple[bytes, bool, bool]:
    """Send ``data`` while reading the replies, shut the write side, read to EOF.
    (replies, reset, stalled)."""
    sock.setblocking(False)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
    view, sent, got, reset, writing = memoryview(data), 0, [], False, True
    deadline = time.monotonic() + timeout
    try:
        while True:
            if time.monotonic() > deadline:
                return b"".join(got), reset, True
            for _, events in sel.select(1.0):
                if events & selectors.EVENT_READ:
                    try:
                        chunk = sock.recv(1 << 20)
                    except BlockingIOError:
                        chunk = None
                    except (ConnectionResetError, BrokenPipeError):
                        return b"".join(got), True, False
                    if chunk == b"":
                        return b"".join(got), reset, False
                    if chunk:
                        got.append(chunk)
                if writing and events & selectors.EVENT_WRITE:
                    try:
                        sent += sock.send(view[sent : sent + (1 << 20)])
                    except BlockingIOError:
                        pass
                    except (ConnectionResetError, BrokenPipeError):
                        reset, writing = True, False
                        sel.modify(sock, selectors.EVENT_READ)
                    if writing and sent >= len(view):
                        writing = False
                        try:
                            sock.shutdown(socket.SHUT_WR)
                        except OSError:
                            pass
                        sel.modify(sock, selectors.EVENT_READ)
    finally:
        sel.close()


def _tally_replies(data: bytes, replies: collections.Counter) -> int:
    w = _wire()
    pos, n, end = 0, 0, len(data)
    unpack = w.HEADER.unpack_from
    while pos + w.HEADER_SIZE <= end:
        _, _, op, status, _, _, _, body_len = unpack(data, pos)
        replies[f"ERROR {_status_name(status)}" if op == 0 else _op_name(op)] += 1
        pos += w.HEADER_SIZE + body_len
        n += 1
    return n


def _status_name(status: int) -> str:
    try:
        return _wire().Status(status).name
    except ValueError:
        return str(status)


def sender(index: int, seed: int, targets: list, pull_sources: list, quota: int, deadline: float, stop, out) -> None:
    """One fuzzing process: batches until ``quota`` frames, ``deadline`` or ``stop``."""
    rng = random.Random(seed * 1000 + index)
    gens = {
        (kind, auth): FrameGen(rng, kind == "unix", auth, pull_sources)
        for kind in ("tcp", "unix")
        for auth in (False, True)
    }
    stats = collections.Counter()
    replies = collections.Counter()
    frames = 0
    try:
        while frames < quota and time.time() < deadline and not stop.is_set():
            target = rng.choice(targets)
            kind, _, auth = target
            gen = gens[kind, auth]
            try:
                sock = _connect(target)
            except OSError:
                stats["connect_failures"] += 1
                time.sleep(0.01)
                continue
            try:
                if auth:
                    if rng.random() < 0.75:
                        try:
                            if not _authenticate(sock, rng):
                                stats["auth_refused"] += 1
                        except (EOFError, OSError):
                            stats["auth_failures"] += 1
                            continue
                        stats["authenticated"] += 1
                    else:
                        stats["unauthenticated_connections"] += 1
                data, n = gen.batch()
                got, reset, stalled = _exchange(sock, data, EXCHANGE_TIMEOUT)
                frames += n
                stats["connections"] += 1
                stats["resets"] += reset
                stats["stalls"] += stalled
                stats["replies"] += _tally_replies(got, replies)
            finally:
                sock.close()
    finally:
        sent = collections.Counter()
        mutations = collections.Counter()
        for gen in gens.values():
            sent.update(gen.sent)
            mutations.update(gen.mutations)
        out.put(
            {
                "frames": frames,
                "stats": dict(stats),
                "sent": dict(sent),
                "mutations": dict(mutations),
                "replies": dict(replies),
            }
        )


# -- gRPC ------------------------------------------------------------------------------------
def grpc_methods() -> list[tuple[str, object]]:
    """(path, input message descriptor) of every method of every service in the proto."""
    from kvstore_client.proto import kvstore_pb2 as pb

    return [
        (f"/{service.full_name}/{method.name}", method.input_type)
        for service in pb.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    ]


_STRINGS = (
    "",
    "a",
    "fuzz",
    "127.0.0.1:1",
    "x" * 129,
    "x" * 5000,
    "a\0b",
    "\u00e9\u6f22\U0001f600",
    "../..",
    "node-1",
    "-1",
    "NaN",
)


def _scalar(field, rng: random.Random):
    from google.protobuf.descriptor import FieldDescriptor as F

    t = field.type
    if t in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        return rng.choice((0.0, 1.0, -1.0, float("nan"), float("inf"), -float("inf"), 1e300, rng.random() * 100))
    if t == F.TYPE_BOOL:
        return rng.random() < 0.5
    if t == F.TYPE_STRING:
        if rng.random() < 0.3:
            return "".join(chr(rng.randrange(1, 0x2FF)) for _ in range(rng.randrange(40)))
        return rng.choice(_STRINGS)
    if t == F.TYPE_BYTES:
        return rng.randbytes(rng.choice((0, 1, 8, 16, 32, 64, 65, 255, 4096)))
    if t == F.TYPE_ENUM:
        return rng.choice([v.number for v in field.enum_type.values] + [99, -1])
    bits = 64 if t in (F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64, F.TYPE_UINT64, F.TYPE_FIXED64) else 32
    if t in (F.TYPE_UINT64, F.TYPE_FIXED64, F.TYPE_UINT32, F.TYPE_FIXED32):
        return rng.choice((0, 1, 2, 16, 1000, 2**bits - 1, 2 ** (bits - 1), rng.randrange(2**bits)))
    return rng.choice((0, 1, -1, 2, 1000, 2 ** (bits - 1) - 1, -(2 ** (bits - 1)), rng.randrange(-1000, 1000)))


def _repeated(field) -> bool:
    is_repeated = getattr(field, "is_repeated", None)
    if is_repeated is not None:
        return bool(is_repeated)
    return field.label == field.LABEL_REPEATED


def random_message(descriptor, rng: random.Random, depth: int = 0):
    """A message of ``descriptor`` with random fields set (nested messages to depth 3)."""
    from google.protobuf import message_factory

    msg = message_factory.GetMessageClass(descriptor)()
    for field in descriptor.fields:
        if rng.random() < 0.3:
            continue
        try:
            if field.message_type is not None and field.message_type.GetOptions().map_entry:
                key_f, value_f = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
                target = getattr(msg, field.name)
                for _ in range(rng.choice((0, 1, 3, 50))):
                    k = _scalar(key_f, rng)
                    if value_f.message_type is not None:
                        target[k].CopyFrom(random_message(value_f.message_type, rng, depth + 1))
                    else:
                        target[k] = _scalar(value_f, rng)
            elif _repeated(field):
                if field.message_type is not None:
                    n = rng.choice((0, 1, 2, 5, 20)) if depth < 2 else rng.choice((0, 1, 2))
                else:
                    n = rng.choice((0, 1, 2, 5, 20, 200, 2000))
                target = getattr(msg, field.name)
                for _ in range(n):
                    if field.message_type is not None:
                        target.add().CopyFrom(random_message(field.message_type, rng, depth + 1))
                    else:
                        target.append(_scalar(field, rng))
            elif field.message_type is not None:
                if depth < 3:
                    getattr(msg, field.name).CopyFrom(random_message(field.message_type, rng, depth + 1))
            else:
                setattr(msg, field.name, _scalar(field, rng))
        except (ValueError, TypeError, OverflowError):
            pass
    return msg


def _mutate(data: bytes, rng: random.Random) -> bytes:
    data = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        r = rng.random()
        if not data or r < 0.25:
            data[rng.randrange(len(data) + 1) if data else 0 : 0] = rng.randbytes(rng.randint(1, 16))
        elif r < 0.5:
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
        elif r < 0.75:
            del data[rng.randrange(len(data)) :]
        else:
            i = rng.randrange(len(data))
            data[i] = rng.choice((0, 0x7F, 0x80, 0xFF))
    return bytes(data)


def _broken_body(descriptor, rng: random.Random, r: float) -> tuple[str, bytes]:
    """(kind, body) of a message body that is not one, for a draw ``r`` past the well-formed
    ones: a mutated serialization (r < 0.85), garbage (< 0.95) or nothing."""
    if r < 0.85:
        return "mutated", _mutate(random_message(descriptor, rng).SerializeToString(), rng)
    if r < 0.95:
        return "garbage", rng.randbytes(rng.choice((1, 5, 64, 1000, 100000)))
    return "empty", b""


def grpc_fuzzer(master: str, seed: int, deadline: float, stop, out, in_flight: int = 8) -> None:
    """Calls every gRPC method with random / mutated / garbage bodies until ``deadline`` or ``stop``."""
    import grpc

    rng = random.Random(seed * 7919 + 17)
    channel = grpc.insecure_channel(
        master, options=[("grpc.max_send_message_length", 16 * MiB), ("grpc.max_receive_message_length", 64 * MiB)]
    )
    methods = grpc_methods()
    calls = {path: channel.unary_unary(path) for path, _ in methods}  # raw bytes both ways
    codes: dict[str, collections.Counter] = {path: collections.Counter() for path, _ in methods}
    kinds = collections.Counter()
    pending = collections.deque()

    def settle(item) -> None:
        path, future = item
        try:
            future.result()
            codes[path]["OK"] += 1
        except grpc.RpcError as exc:
            codes[path][exc.code().name] += 1
        except Exception as exc:  # noqa: BLE001 - count whatever the channel raises
            codes[path][type(exc).__name__] += 1

    try:
        while time.time() < deadline and not stop.is_set():
            path, descriptor = rng.choice(methods)
            r = rng.random()
            if r < 0.6:
                kind, body = "random", random_message(descriptor, rng).SerializeToString()
            else:
                kind, body = _broken_body(descriptor, rng, r)
            kinds[kind] += 1
            pending.append((path, calls[path].future(body, timeout=10)))
            while len(pending) >= in_flight:
                settle(pending.popleft())
        while pending:
            settle(pending.popleft())
    finally:
        channel.close()
        out.put({"grpc": {path: dict(c) for path, c in codes.items()}, "grpc_kinds": dict(kinds)})


# -- the conductor port ----------------------------------------------------------------------
CONDUCTOR_NAMESPACE = "fuzz-conductor"  # where the conductor fuzzer registers engines, so some Schedules are placed
CONDUCTOR_HELD = 8  # connections left open mid-frame at a time
CONDUCTOR_BUSY_BURST = 8  # connections over the port's limit opened once, each expecting BUSY
# hostile last frames the master must answer BAD_FRAME (when it did not reset the connection)
_STRICT_HOSTILE = ("magic", "version", "unknown_method", "body_len_over", "auth_oversize")
_LOOSE_HOSTILE = ("cut_header", "cut_body", "garbage", "bitflip")


def _cwire():
    from kvstore_client import conductor_wire

    return conductor_wire


class ConductorFrames:
    """Frames for the conductor port: valid headers with plausible, random (``random_message``),
    mutated (``_mutate``), garbage or empty bodies of ScheduleRequest / RequestEvent, AUTH with
    random tokens, and a hostile last frame (bad magic / version / method, a size over the
    bound, an oversized AUTH, a frame cut short, garbage, a flipped bit)."""

    def __init__(self, rng: random.Random):
        cw = self.cw = _cwire()
        self.rng = rng
        self.requests = [f"cf-{i}" for i in range(64)]  # request ids that Schedule and ReportRequest share
        self.unknown_methods = [code for code in range(256) if code not in set(cw.Method)]
        self.bodies = collections.Counter()  # body kind -> frames
        self.hostile_kinds = collections.Counter()

    def request_id(self) -> int:
        r = self.rng.random()
        return self.rng.getrandbits(32) if r < 0.95 else self.rng.choice((0, 1, 2**32 - 1))

    def plausible(self, method) -> bytes:
        from kvstore_client.proto import kvstore_pb2 as pb

        rng, cw = self.rng, self.cw
        if method == cw.Method.SCHEDULE:
            n = rng.choice((0, 1, 4, 16, 64))
            return pb.ScheduleRequest(
                namespace=CONDUCTOR_NAMESPACE,
                request_id=rng.choice(self.requests + [""]),
                digests=[rng.randrange(256).to_bytes(16, "little") for _ in range(n)],
                input_length=n * 16 + rng.randrange(16),
                output_length=rng.choice((0, 1, 128, 4096)),
                start_prefill=rng.random() < 0.5,
            ).SerializeToString()
        return pb.RequestEvent(
            namespace=CONDUCTOR_NAMESPACE, request_id=rng.choice(self.requests), stage=rng.randrange(5)
        ).SerializeToString()

    def body(self, method, small: bool = False) -> bytes:
        """A body for ``method``; ``small``: a plausible one (for the long pipelined bursts)."""
        rng, cw = self.rng, self.cw
        if method == cw.Method.AUTH:
            self.bodies["auth"] += 1
            return rng.randbytes(rng.choice((0, 1, 16, 32, 200, cw.MAX_TOKEN_BYTES) if not small else (0, 32)))
        descriptor = cw.BODIES[method][0].DESCRIPTOR
        r = 0.0 if small else rng.random()
        if r < 0.3:
            kind, body = "plausible", self.plausible(method)
        elif r < 0.65:
            msg = random_message(descriptor, rng)
            if rng.random() < 0.4:  # past the namespace check, into the conductor
                msg.namespace = CONDUCTOR_NAMESPACE
            kind, body = "random", msg.SerializeToString()
        else:
            kind, body = _broken_body(descriptor, rng, r)
        self.bodies[kind] += 1
        return body

    def frame(self, small: bool = False) -> tuple[bytes, int, int]:
        """A frame with a valid header: (bytes, method, request_id)."""
        cw, rng = self.cw, self.rng
        method = rng.choice((cw.Method.SCHEDULE, cw.Method.SCHEDULE, cw.Method.REPORT_REQUEST, cw.Method.AUTH))
        body, rid = self.body(method, small), self.request_id()
        return cw.pack_header(method, rid, len(body)) + body, method, rid

    def hostile(self) -> tuple[bytes, str]:
        cw, rng = self.cw, self.rng
        kind = rng.choice(_STRICT_HOSTILE + _LOOSE_HOSTILE)
        rid = self.request_id()
        method = rng.choice(list(cw.Method))
        if kind == "magic":
            head = cw.HEADER.pack(rng.choice((b"KV", b"CK", b"\0\0", rng.randbytes(2))), cw.VERSION, method, rid, 0)
        elif kind == "version":
            head = cw.HEADER.pack(cw.MAGIC, rng.choice((0, 2, 255)), method, rid, 0)
        elif kind == "unknown_method":
            head = cw.pack_header(rng.choice(self.unknown_methods), rid, rng.choice((0, 8, 4096)))
        elif kind == "body_len_over":
            head = cw.pack_header(method, rid, rng.choice((cw.MAX_BODY_BYTES + 1, 2**31, 2**32 - 1)))
        elif kind == "auth_oversize":
            head = cw.pack_header(cw.Method.AUTH, rid, rng.choice((cw.MAX_TOKEN_BYTES + 1, 65536, cw.MAX_BODY_BYTES)))
        elif kind == "cut_header":
            head = self.frame()[0][: rng.randrange(1, cw.HEADER_SIZE)]
        elif kind == "cut_body":
            frame = self.frame()[0]
            while len(frame) <= cw.HEADER_SIZE:
                frame = self.frame()[0]
            head = frame[: rng.randrange(cw.HEADER_SIZE, len(frame))]
        elif kind == "garbage":
            head = rng.randbytes(rng.choice((1, 11, 12, 13, 100, 4096)))
        else:  # bitflip
            frame = bytearray(self.frame()[0])
            i = rng.randrange(min(len(frame), cw.HEADER_SIZE + 16))
            frame[i] ^= 1 << rng.randrange(8)
            head = bytes(frame)
        self.hostile_kinds[kind] += 1
        return head, kind


def _parse_conductor_replies(data: bytes, reset: bool) -> tuple[list[tuple[int, int, bytes]], list[str]]:
    """The replies in ``data`` as (status, request_id, body), and what is wrong with the stream (a
    header that is not one, an unknown status, a size over the bound, bytes after the last frame;
    a frame cut short only when the connection was not reset)."""
    cw = _cwire()
    replies, problems, pos, end = [], [], 0, len(data)
    while pos < end:
        if end - pos < cw.HEADER_SIZE:
            if not reset:
                problems.append(f"{end - pos} bytes after the last reply: not a header")
            break
        magic, version, status, rid, body_len = cw.HEADER.unpack_from(data, pos)
        if magic != cw.MAGIC or version != cw.VERSION:
            problems.append(f"a reply header with magic {magic!r}, version {version}")
            break
        if status not in set(cw.Status):
            problems.append(f"a reply with unknown status {status}")
            break
        if body_len > cw.MAX_BODY_BYTES:
            problems.append(f"a reply body of {body_len} bytes")
            break
        if pos + cw.HEADER_SIZE + body_len > end:
            if not reset:
                problems.append(f"a reply cut short ({end - pos - cw.HEADER_SIZE} of {body_len} body bytes)")
            break
        replies.append((status, rid, data[pos + cw.HEADER_SIZE : pos + cw.HEADER_SIZE + body_len]))
        pos += cw.HEADER_SIZE + body_len
    return replies, problems


def _reply_body_problem(method: int, status: int, body: bytes) -> str | None:
    """What is wrong with a reply's body for its method and status (None: nothing)."""
    from google.protobuf.message import DecodeError

    cw = _cwire()
    try:
        if status == cw.Status.OK and method in cw.BODIES:
            cw.BODIES[method][1].FromString(body)
        elif status == cw.Status.REJECTED:
            if method != cw.Method.SCHEDULE:
                return f"REJECTED answers {cw.Method(method).name}"
            from kvstore_client.proto import kvstore_pb2 as pb

            if not pb.ScheduleReply.FromString(body).reason:
                return "a REJECTED ScheduleReply without a reason"
        else:
            body.decode("utf-8")
    except (DecodeError, UnicodeDecodeError) as exc:
        return f"{cw.Status(status).name} body for {cw.Method(method).name}: {type(exc).__name__}"
    return None


def _check_conductor_replies(
    data: bytes, expected: list, hostile: str | None, reset: bool, stalled: bool, tally, by_method=None
):
    """Problems with one connection's replies: each frame with a valid header is answered in order
    with its request_id and a body that decodes; nothing follows UNAUTHENTICATED, BAD_FRAME or
    BUSY; a strict hostile last frame is answered BAD_FRAME. ``tally``: status name -> replies;
    ``by_method``: (method name, status name) -> replies to the frames with a valid header."""
    cw = _cwire()
    replies, problems = _parse_conductor_replies(data, reset)
    closing = {cw.Status.UNAUTHENTICATED, cw.Status.BAD_FRAME, cw.Status.BUSY}
    closed = False
    for i, (status, rid, body) in enumerate(replies):
        tally[cw.Status(status).name] += 1
        if closed:
            problems.append(f"a reply after {closed.name}")
            break
        if status in closing:
            closed = cw.Status(status)
        if status == cw.Status.BUSY and i == 0:
            continue
        if i < len(expected):
            method, want = expected[i]
            if by_method is not None:
                by_method[cw.Method(method).name, cw.Status(status).name] += 1
            if rid != want:
                problems.append(f"reply {i} has request_id {rid}, frame {i} had {want}")
            elif status == cw.Status.BAD_FRAME:
                problems.append(f"BAD_FRAME for a well-formed {cw.Method(method).name} frame")
            else:
                problem = _reply_body_problem(method, status, body)
                if problem:
                    problems.append(problem)
        elif i == len(expected) and hostile is not None:
            if hostile in _STRICT_HOSTILE and status != cw.Status.BAD_FRAME:
                problems.append(f"{cw.Status(status).name} for a hostile {hostile} frame")
            elif hostile in ("cut_header", "cut_body"):
                problems.append(f"{cw.Status(status).name} for a frame cut short ({hostile})")
        elif hostile not in ("garbage", "bitflip"):  # the rest of a flipped frame may read as more frames
            problems.append(f"{len(replies)} replies to {len(expected) + (hostile is not None)} frames")
            break
    if not reset and not stalled and not closed:
        if len(replies) < len(expected):
            problems.append(f"{len(expected) - len(replies)} of {len(expected)} frames unanswered")
        elif hostile in _STRICT_HOSTILE and len(replies) == len(expected):
            problems.append(f"a hostile {hostile} frame unanswered")
    return len(replies), problems


def _conductor_connect(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _register_engines(master: str, node_id: str) -> int:
    """A prefill and a decode engine in CONDUCTOR_NAMESPACE (over gRPC); how many registered."""
    import grpc

    from kvstore_client.proto import kvstore_pb2 as pb
    from kvstore_client.proto import kvstore_pb2_grpc as pb_grpc

    registered = 0
    with grpc.insecure_channel(master) as channel:
        stub = pb_grpc.ConductorStub(channel)
        for engine_id, role in (("cf-prefill", pb.PREFILL), ("cf-decode", pb.DECODE)):
            try:
                stub.RegisterEngine(
                    pb.EngineRegistration(
                        namespace=CONDUCTOR_NAMESPACE, engine_id=engine_id, role=role, node_id=node_id
                    ),
                    timeout=10,
                )
                registered += 1
            except grpc.RpcError:
                pass
    return registered


def _conductor_probe(address: str) -> str | None:
    """A well-formed AUTH and Schedule on a fresh connection; None when both were answered right."""
    cw = _cwire()
    from kvstore_client.proto import kvstore_pb2 as pb

    body = pb.ScheduleRequest(namespace=CONDUCTOR_NAMESPACE, digests=[bytes(16)], input_length=16).SerializeToString()
    data = cw.pack_header(cw.Method.AUTH, 1, 0) + cw.pack_header(cw.Method.SCHEDULE, 2, len(body)) + body
    try:
        with _conductor_connect(address) as sock:
            got, reset, stalled = _exchange(sock, data, EXCHANGE_TIMEOUT)
    except OSError as exc:
        return f"probe: {type(exc).__name__}: {exc}"
    replies, problems = _parse_conductor_replies(got, reset)
    statuses = [cw.Status(s).name for s, _, _ in replies]
    if (
        problems
        or reset
        or stalled
        or len(replies) != 2
        or statuses[0] != "OK"
        or statuses[1] not in ("OK", "REJECTED", "INVALID")
    ):
        return f"probe: replies {statuses}, reset {reset}, stalled {stalled}, {problems}"
    return None


def conductor_fuzzer(address: str, seed: int, deadline: float, stop, out, master: str = "", node_id: str = "") -> None:
    """Fuzzes the master's conductor port at ``address`` until ``deadline`` or ``stop``: connections
    of pipelined frames (usually one burst, now and then a long one) ending in a hostile frame or
    not, read to EOF and checked (``_check_conductor_replies``); some closed right after sending,
    some left open mid-frame for a while, and once a burst of connections over the port's limit.
    With ``master`` and ``node_id`` it first registers two engines so that Schedules get placed.
    At the end a well-formed AUTH and Schedule must still be answered (``probe``)."""
    from kvstore.master.conductor_port import DEFAULT_MAX_CONNECTIONS

    cw = _cwire()
    rng = random.Random(seed * 104729 + 3)
    gen = ConductorFrames(rng)
    stats, statuses, by_method = collections.Counter(), collections.Counter(), collections.Counter()
    errors: list[str] = []
    held: collections.deque = collections.deque()
    probe = "not run"
    burst_done = False

    def fail(what: str) -> None:
        stats["malformed_replies"] += 1
        if len(errors) < 10:
            errors.append(what)

    def busy_burst() -> None:
        """Fill the port (its ``DEFAULT_MAX_CONNECTIONS``) and a few more: each of those must be
        answered BUSY alone (the port then serves again once the others are closed)."""
        socks = []
        try:
            for _ in range(DEFAULT_MAX_CONNECTIONS + CONDUCTOR_BUSY_BURST):
                socks.append(_conductor_connect(address))
            for sock in socks[-CONDUCTOR_BUSY_BURST:]:
                got, reset, stalled = _exchange(sock, b"", EXCHANGE_TIMEOUT)
                stats["stalls"] += stalled
                replies, problems = _parse_conductor_replies(got, reset)
                for status, _, _ in replies:
                    statuses[cw.Status(status).name] += 1
                stats["busy_replies"] += sum(1 for s, _, _ in replies if s == cw.Status.BUSY)
                if not reset and not stalled and [s for s, _, _ in replies] != [cw.Status.BUSY]:
                    problems.append(f"replies {[cw.Status(s).name for s, _, _ in replies]} past the limit, not BUSY")
                for problem in problems:
                    fail(f"busy burst: {problem}")
        except OSError:
            stats["connect_failures"] += 1
        finally:
            stats["connections"] += len(socks)
            stats["busy_burst_connections"] += len(socks)
            for sock in socks:
                sock.close()

    try:
        if master and node_id:
            stats["engines_registered"] = _register_engines(master, node_id)
        while time.time() < deadline and not stop.is_set():
            if stats["connections"] >= 100 and not burst_done:
                burst_done = True
                for sock in held:
                    sock.close()
                held.clear()
                time.sleep(0.5)  # the port's threads of the connections just closed end
                busy_burst()
                continue
            try:
                sock = _conductor_connect(address)
            except OSError:
                stats["connect_failures"] += 1
                time.sleep(0.01)
                continue
            stats["connections"] += 1
            mode = rng.random()
            if mode < 0.04:  # left open mid-frame for a while
                sock.sendall(gen.frame()[0][: rng.randrange(cw.HEADER_SIZE)])
                stats["frames"] += 1
                stats["held"] += 1
                held.append(sock)
                if len(held) > CONDUCTOR_HELD:
                    held.popleft().close()
                continue
            frames, expected = [], []
            if rng.random() < 0.3:
                frames.append(cw.pack_header(cw.Method.AUTH, 0, 0))
                expected.append((cw.Method.AUTH, 0))
            burst = rng.random() < 0.05  # a long pipelined burst of plausible frames
            n = rng.randint(500, 3000) if burst else min(int(rng.expovariate(1 / 20)) + 1, 500)
            for _ in range(n):
                frame, method, rid = gen.frame(small=burst)
                frames.append(frame)
                expected.append((method, rid))
            hostile = None
            if rng.random() < 0.6:
                frame, hostile = gen.hostile()
                frames.append(frame)
                if hostile in _STRICT_HOSTILE and rng.random() < 0.2:  # bytes after it: the master may reset
                    frames.append(rng.randbytes(rng.choice((1, 12, 1000))))
            stats["frames"] += len(frames)
            data = b"".join(frames)
            try:
                if mode < 0.12:  # sent and closed at once, replies unread
                    stats["abandoned"] += 1
                    sock.sendall(data[: rng.randrange(1, min(len(data), 1 << 16) + 1)])
                    continue
                got, reset, stalled = _exchange(sock, data, EXCHANGE_TIMEOUT)
            except OSError:
                stats["resets"] += 1
                continue
            finally:
                sock.close()
            stats["resets"] += reset
            stats["stalls"] += stalled
            replies, problems = _check_conductor_replies(got, expected, hostile, reset, stalled, statuses, by_method)
            stats["replies"] += replies
            for problem in problems:
                fail(problem)
        for sock in held:
            sock.close()
        held.clear()
        time.sleep(0.2)
        probe = _conductor_probe(address)
    except Exception as exc:  # noqa: BLE001 - reported, and fails the run
        probe = f"the conductor fuzzer failed: {type(exc).__name__}: {exc}"
    finally:
        for sock in held:
            sock.close()
        out.put(
            {
                "conductor_port": {
                    "frames": stats["frames"],
                    "connections": stats["connections"],
                    "replies": stats["replies"],
                    "statuses": dict(sorted(statuses.items())),
                    "statuses_by_method": {
                        name: {status: n for (m, status), n in sorted(by_method.items()) if m == name}
                        for name in sorted({m for m, _ in by_method})
                    },
                    "bodies": dict(sorted(gen.bodies.items())),
                    "hostile_frames": dict(sorted(gen.hostile_kinds.items())),
                    "resets": stats["resets"],
                    "stalls": stats["stalls"],
                    "abandoned": stats["abandoned"],
                    "held_open": stats["held"],
                    "busy_burst_connections": stats["busy_burst_connections"],
                    "busy_replies": stats["busy_replies"],
                    "connect_failures": stats["connect_failures"],
                    "engines_registered": stats["engines_registered"],
                    "malformed_replies": stats["malformed_replies"],
                    "errors": errors,
                    "probe": probe or "ok",
                }
            }
        )


# -- the well-behaved client ---------------------------------------------------------------
class GoodClient:
    """Puts random values and reads them back on its own connections, all the time."""

    def __init__(self, plain, auth, master: str, seed: int):
        self.targets = [
            ("tcp", plain.record["data"], False),
            ("unix", plain.record["unix_socket"], False),
            ("tcp", auth.record["data"], True),
        ]
        self.master = master
        self.rng = random.Random(seed)
        self.ops = collections.Counter()
        self.failures = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._loop, args=(t, i), daemon=True) for i, t in enumerate(self.targets)
        ]
        self._threads.append(threading.Thread(target=self._master_loop, daemon=True))

    def _fail(self, what: str) -> None:
        self.failures += 1
        if len(self.errors) < 10:
            self.errors.append(what)

    def _open(self, target):
        from kvstore_client.credentials import Credentials
        from kvstore_client.transport import TcpConnection, UnixConnection

        kind, where, auth = target
        credentials = Credentials(ADMIN_TOKEN) if auth else Credentials(None)
        if kind == "unix":
            return UnixConnection(where, credentials=credentials, timeout=30)
        return TcpConnection(where, credentials=credentials, timeout=30)

    def _loop(self, target, index: int) -> None:
        rng = random.Random(self.rng.random())
        name = f"{target[0]}{'+auth' if target[2] else ''}"
        conn, i = None, 0
        while not self._stop.is_set():
            try:
                if conn is None:
                    conn = self._open(target)
                key = ("good", (index << 32 | i % 256).to_bytes(16, "little"))
                value = rng.randbytes(rng.randint(1, 64 * 1024))
                conn.put(key, value)
                got = conn.get(key)
                self.ops[name] += 2
                if got != value:
                    self._fail(f"{name}: get of {key!r} returned {'nothing' if got is None else 'other bytes'}")
                if i % 16 == 0:
                    if not conn.exists(key):
                        self._fail(f"{name}: exists({key!r}) false right after a put")
                    self.ops[name] += 1
                i += 1
            except Exception as exc:  # noqa: BLE001 - any error is a failure of the good client
                self._fail(f"{name}: {type(exc).__name__}: {exc}")
                if conn is not None:
                    try:
                        conn.close()
                    except Exception:  # noqa: BLE001
                        pass
                conn = None
                time.sleep(0.1)
            time.sleep(0.01)
        if conn is not None:
            conn.close()

    def _master_loop(self) -> None:
        import grpc

        from kvstore_client.proto import kvstore_pb2 as pb
        from kvstore_client.proto import kvstore_pb2_grpc as pb_grpc

        with grpc.insecure_channel(self.master) as channel:
            stub = pb_grpc.MasterStub(channel)
            while not self._stop.wait(0.25):
                try:
                    stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=10)
                    self.ops["master"] += 1
                except grpc.RpcError as exc:
                    self._fail(f"master ClusterStatus: {exc.code().name}: {exc.details()}")

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)


# -- the run ---------------------------------------------------------------------------------
class Sampler:
    """/proc samples of each service every ``interval`` seconds; notes crashes."""

    def __init__(self, services: dict, interval: float = 1.0):
        self.services = services
        self.interval = interval
        self.series: dict[str, list] = {name: [] for name in services}
        self.crashed: dict[str, bool] = {name: False for name in services}
        self._stop = threading.Event()
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def sample(self) -> None:
        t = round(time.monotonic() - self._start, 2)
        for name, service in self.services.items():
            if not service.alive():
                self.crashed[name] = True
                continue
            s = proc_sample(service.pid)
            if s is not None:
                self.series[name].append({"t": t, **s})

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def start(self) -> None:
        self.sample()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def summary(self, name: str) -> dict:
        series = self.series[name]
        if not series:
            return {"crashed": self.crashed[name]}
        start, end = series[0], series[-1]
        return {
            "crashed": self.crashed[name],
            "start": start,
            "end": end,
            "peak": {k: max(s[k] for s in series) for k in start if k != "t"},
            "rss_anon_growth": end["rss_anon"] - start["rss_anon"],
            "fd_growth": end["fds"] - start["fds"],
        }


def run(frames: int, seconds: float, seed: int, senders: int, workdir: Path, grpc_in_flight: int = 8) -> dict:
    access = write_access_file(workdir)
    master = start_master(workdir)
    address = master.record["master"]
    services = {"master": master}
    try:
        services["node"] = start_node(address, workdir, "node", NODE_DRAM, NODE_SSD, NODE_MAX_BLOCK)
        services["node_auth"] = start_node(
            address, workdir, "node_auth", NODE_DRAM, NODE_SSD, NODE_MAX_BLOCK, ("--auth", str(access))
        )
        plain, auth = services["node"], services["node_auth"]
        targets = [
            ("tcp", plain.record["data"], False),
            ("unix", plain.record["unix_socket"], False),
            ("unix", plain.record["unix_socket"], False),
            ("tcp", auth.record["data"], True),
            ("unix", auth.record["unix_socket"], True),
        ]
        pull_sources = [plain.record["data"], auth.record["data"]]
        good = GoodClient(plain, auth, address, seed)
        good.start()
        time.sleep(1.0)  # the good client's connections and first blocks in place
        sampler = Sampler(services)
        sampler.start()
        ctx = multiprocessing.get_context("spawn")
        stop, out = ctx.Event(), ctx.Queue()
        started = time.time()
        deadline = started + seconds
        procs = [
            ctx.Process(
                target=sender,
                args=(i, seed, targets, pull_sources, -(-frames // senders), deadline, stop, out),
                daemon=True,
            )
            for i in range(senders)
        ]
        procs.append(
            ctx.Process(target=grpc_fuzzer, args=(address, seed, deadline, stop, out, grpc_in_flight), daemon=True)
        )
        procs.append(
            ctx.Process(
                target=conductor_fuzzer,
                args=(master.record["conductor"], seed, deadline, stop, out, address, plain.record["node_id"]),
                daemon=True,
            )
        )
        for p in procs:
            p.start()
        results = []
        while len(results) < len(procs):  # the senders end on their own; then the other fuzzers are stopped
            try:
                results.append(out.get(timeout=1.0))
            except Exception:  # noqa: BLE001 - queue.Empty
                pass
            if sum(1 for r in results if "frames" in r) == senders:
                stop.set()
            if not all(s.alive() for s in services.values()):
                stop.set()
            if time.time() > deadline + 120:
                break
        elapsed = time.time() - started
        for p in procs:
            p.join(30)
        # the fuzzing connections are closed: give the node's threads a moment to end
        wait_until = time.monotonic() + 10
        first = {name: (s[0]["fds"] if s else 0) for name, s in sampler.series.items()}
        while time.monotonic() < wait_until:
            now = {name: proc_sample(svc.pid) for name, svc in services.items() if svc.alive()}
            if all(v is not None and v["fds"] <= first[name] + FD_BOUND for name, v in now.items()):
                break
            time.sleep(0.25)
        time.sleep(1.0)  # a last stretch of good-client traffic after the fuzzing
        good.stop()
        sampler.stop()
    finally:
        for service in services.values():
            service.close()
        reap_arenas()
    frames_sent = sum(r.get("frames", 0) for r in results)
    stats, sent, mutations, replies = (collections.Counter() for _ in range(4))
    grpc_codes: dict = {}
    grpc_kinds = collections.Counter()
    for r in results:
        stats.update(r.get("stats", {}))
        sent.update(r.get("sent", {}))
        mutations.update(r.get("mutations", {}))
        replies.update(r.get("replies", {}))
        for path, codes in r.get("grpc", {}).items():
            grpc_codes.setdefault(path, collections.Counter()).update(codes)
        grpc_kinds.update(r.get("grpc_kinds", {}))
    all_ops = sorted(op.name for op in _wire().Op if op != _wire().Op.ERROR)
    covered = [name for name in all_ops if sent.get(name)]
    grpc_calls = sum(sum(c.values()) for c in grpc_codes.values())
    conductor = next((r["conductor_port"] for r in results if "conductor_port" in r), None)
    if conductor is None:  # the conductor fuzzer died before it reported
        conductor = {
            "frames": 0,
            "connections": 0,
            "replies": 0,
            "statuses": {},
            "stalls": 0,
            "malformed_replies": 0,
            "errors": [],
            "probe": "no report",
        }
    conductor_ok = (
        conductor["frames"] > 0
        and conductor["malformed_replies"] == 0
        and conductor.get("stalls", 0) == 0
        and conductor["probe"] == "ok"
    )
    processes = {name: sampler.summary(name) for name in services}
    for name, service in services.items():
        processes[name]["tracebacks"] = service.tracebacks()
        processes[name]["exit_status"] = service.proc.returncode
    tracebacks = sum(p["tracebacks"] for p in processes.values())
    crashes = sum(1 for p in processes.values() if p["crashed"])
    bounded = all(
        not p["crashed"] and p.get("rss_anon_growth", 0) < RSS_BOUND and p.get("fd_growth", 0) <= FD_BOUND
        for p in processes.values()
    )
    result = {
        "frames_sent": frames_sent,
        "seconds": round(elapsed, 1),
        "frames_per_s": round(frames_sent / elapsed) if elapsed else 0,
        "connections": stats["connections"],
        "replies": stats["replies"],
        "connection_resets": stats["resets"],
        "stalled_connections": stats["stalls"],
        "connect_failures": stats["connect_failures"],
        "authenticated_connections": stats["authenticated"],
        "ops_covered": f"{len(covered)}/{len(all_ops)}",
        "ops_missing": sorted(set(all_ops) - set(covered)),
        "frames_by_op": dict(sorted(sent.items())),
        "hostile_frames": dict(sorted(mutations.items())),
        "replies_by_kind": dict(sorted(replies.items())),
        "grpc_calls": grpc_calls,
        "grpc_calls_per_s": round(grpc_calls / elapsed) if elapsed else 0,
        "grpc_methods_covered": f"{sum(1 for c in grpc_codes.values() if c)}/{len(grpc_methods())}",
        "grpc_inputs": dict(grpc_kinds),
        "grpc_codes": {path: dict(sorted(c.items())) for path, c in sorted(grpc_codes.items())},
        "conductor_port": conductor,
        "conductor_port_ok": conductor_ok,
        "good_client_ops": dict(good.ops),
        "good_client_failures": good.failures,
        "good_client_errors": good.errors,
        "node_crashes": sum(1 for n in ("node", "node_auth") if processes[n]["crashed"]),
        "crashes": crashes,
        "tracebacks": tracebacks,
        "processes": processes,
        "bounds": {"rss_anon_growth_bytes": RSS_BOUND, "fd_growth": FD_BOUND},
        "bounded": bounded,
        "seed": seed,
        "grpc_in_flight": grpc_in_flight,
    }
    result["ok"] = (
        crashes == 0
        and tracebacks == 0
        and good.failures == 0
        and bounded
        and stats["stalls"] == 0
        and not result["ops_missing"]
        and conductor_ok
    )
    return result


def _mib(n: int) -> str:
    return f"{n / MiB:.0f}"


def table(r: dict) -> str:
    c = r["conductor_port"]
    lines = [
        f"frames sent {r['frames_sent']} in {r['seconds']} s ({r['frames_per_s']}/s), "
        f"{r['connections']} connections, {r['replies']} replies, resets {r['connection_resets']}, "
        f"stalls {r['stalled_connections']}",
        f"ops covered {r['ops_covered']}; frames by op {r['frames_by_op']}",
        f"hostile frames {sum(r['hostile_frames'].values())} {r['hostile_frames']}",
        f"gRPC calls {r['grpc_calls']} ({r['grpc_calls_per_s']}/s), methods {r['grpc_methods_covered']}",
        f"conductor port frames {c['frames']}, {c['connections']} connections, replies {c.get('replies', 0)}, "
        f"statuses {c['statuses']}, resets {c.get('resets', 0)}, stalls {c.get('stalls', 0)}, "
        f"malformed replies {c['malformed_replies']} {c.get('errors', [])}, probe {c['probe']}",
        f"good client ops {r['good_client_ops']}, failures {r['good_client_failures']} {r['good_client_errors']}",
        f"crashes {r['crashes']} (nodes {r['node_crashes']}), tracebacks {r['tracebacks']}",
        "",
        "| process | RSS start / peak / end MiB | anon start / end MiB | fds start / peak / end | threads peak | CPU s |",
        "|---|---|---|---|---|---|",
    ]
    for name, p in r["processes"].items():
        if "start" not in p:
            lines.append(f"| {name} | (no samples; crashed {p['crashed']}) | | | | |")
            continue
        s, k, e = p["start"], p["peak"], p["end"]
        lines.append(
            f"| {name} | {_mib(s['rss'])} / {_mib(k['rss'])} / {_mib(e['rss'])} | "
            f"{_mib(s['rss_anon'])} / {_mib(e['rss_anon'])} | {s['fds']} / {k['fds']} / {e['fds']} | "
            f"{k['threads']} | {e['cpu_s'] - s['cpu_s']:.0f} |"
        )
    lines.append("")
    lines.append("ok" if r["ok"] else "NOT OK")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=1_000_000, help="data-plane frames to send in all")
    parser.add_argument("--seconds", type=float, default=180.0, help="stop after this long even if short of --frames")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--senders", type=int, default=2, help="data-plane fuzzing processes")
    parser.add_argument("--grpc-in-flight", type=int, default=8, help="gRPC fuzzing calls in flight at a time")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.grpc_in_flight < 1 or args.senders < 1:
        parser.error("--grpc-in-flight and --senders must be at least 1")
    with tempfile.TemporaryDirectory(prefix="kvstore-fuzz-") as workdir:
        result = run(args.frames, args.seconds, args.seed, args.senders, Path(workdir), args.grpc_in_flight)
        if not result["ok"]:  # keep what the processes logged where it can be read
            for name in ("master", "node", "node_auth"):
                text = (Path(workdir) / f"{name}.err").read_text(errors="replace")
                if "Traceback" in text:
                    result.setdefault("traceback_excerpts", {})[name] = text[text.index("Traceback") :][:3000]
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(table(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
