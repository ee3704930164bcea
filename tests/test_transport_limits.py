"""What one client can make a node hold (proto/dataplane.md, Connections; kvstore.transport.limits).

A real node process (``kvstore node``) with its stderr in a file, hostile frames
from raw sockets: announced tables and bodies cost no memory before their bytes
arrive, the ops that hold node memory are same-host only and capped, malformed
keys are item statuses (never a traceback), and the connection cap and idle
timeout behave as documented.
"""

from __future__ import annotations

import os
import random
import select
import socket
import struct
import subprocess
import sys
import time

import pytest
import xxhash

from kvstore_client.errors import ProtocolError, ServiceUnavailable, TransportError
from kvstore_client.shm import ShmConnection
from kvstore_client.transport import TcpConnection, UnixConnection
from kvstore_client.wire import (
    FLAG_NO_REPLY,
    FLAG_REGRANT,
    HEADER,
    KEY_HEAD,
    KEYED_OPS,
    KEYLESS_OPS,
    PUT_ENTRY,
    RESERVE_ENTRY,
    Op,
    Status,
    error_for,
    key_entry,
    pack_header,
    put_entry,
)
from tests.processes import ROOT, recv_exact, start_master

MiB = 1 << 20
DRAM, MAX_BLOCK = 256 * MiB, 4 * MiB
MAX_FRAME = 64 * MiB  # the node's default: max(64 MiB, max_block + 1 MiB)
GRANT_CAP = DRAM // 8  # kvstore.node.store.GRANT_SHARE


class NodeProcess:
    """``kvstore node`` in a process of its own, its stderr kept in a file to read at any time."""

    def __init__(self, master: str, tmp_path, *flags: str):
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.err_path = tmp_path / "node.err"
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kvstore.cli",
                    "node",
                    "--master",
                    master,
                    "--port",
                    "0",
                    "--metrics-port",
                    "-1",
                    "--data-dir",
                    str(tmp_path / "data"),
                    "--dram",
                    f"{DRAM // MiB}MiB",
                    "--ssd",
                    "0",
                    "--max-block",
                    f"{MAX_BLOCK // MiB}MiB",
                    *flags,
                    "--json",
                ],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        import json

        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"node did not start:\n{self.stderr()}")
        record = json.loads(line)
        self.address, self.unix_path = record["data"], record["unix_socket"]

    def stderr(self) -> str:
        return self.err_path.read_text()

    def rss_anon(self) -> int:
        """The node's anonymous resident memory, bytes (what a header must not make it allocate)."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no RssAnon in /proc/<pid>/status")

    def tcp(self) -> socket.socket:
        host, port = self.address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=30)
        sock.settimeout(30)
        return sock

    def unix(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(30)
        sock.connect(self.unix_path)
        return sock

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        from kvstore.tiers.arena import reap_stale_arenas

        reap_stale_arenas()


@pytest.fixture(scope="module")
def master():
    service = start_master()
    yield service.record["master"]
    service.close()


@pytest.fixture(scope="module")
def node(master, tmp_path_factory):
    process = NodeProcess(master, tmp_path_factory.mktemp("limits"))
    yield process
    process.close()


@pytest.fixture(autouse=True)
def no_tracebacks(request):
    """No frame of any kind may make a node log a traceback."""
    yield
    if "node" in request.fixturenames:
        assert_no_traceback(request.getfixturevalue("node"))


def assert_no_traceback(node: "NodeProcess") -> None:
    text = node.stderr()
    assert "Traceback" not in text, text[-4000:]


def key(name: str) -> tuple[str, bytes]:
    return ("ns", xxhash.xxh3_128_digest(name.encode()))


def read_reply(sock: socket.socket) -> tuple[int, int, int, bytes]:
    """(op, status, count, body) of the next frame from the node."""
    magic, version, op, status, _, _, count, body_len = HEADER.unpack(recv_exact(sock, HEADER.size))
    assert (magic, version) == (b"KV", 1)
    return op, status, count, recv_exact(sock, body_len)


def closed(sock: socket.socket) -> bool:
    """Whether the node has closed ``sock`` (EOF or reset), reading what is left."""
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


def expect_error(sock: socket.socket, status: int) -> str:
    """An ERROR frame of ``status``, then the node closes the connection."""
    op, got, _, body = read_reply(sock)
    assert (op, got) == (Op.ERROR, status), body
    assert closed(sock)
    return body.decode()


def serves(node: NodeProcess, name: str = "probe") -> None:
    """A well-behaved SDK client still gets its round trip."""
    k, value = key(name), os.urandom(256 * 1024)
    with TcpConnection(node.address, timeout=60) as conn:
        conn.put(k, value)
        assert conn.get(k) == value


def wait_for(predicate, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, "condition not met (generous deadline)"
        time.sleep(0.05)


# -- memory before bytes arrive --------------------------------------------------------------------
def _peak_rss(node: NodeProcess, seconds: float = 1.0) -> int:
    """The node's largest anonymous RSS over a short window (it reacts to a header at once)."""
    peak, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        peak = max(peak, node.rss_anon())
        time.sleep(0.05)
    return peak


def test_announced_tables_and_bodies_cost_no_memory_until_their_bytes_arrive(node):
    serves(node, "warm-up")
    warm = [node.tcp() for _ in range(40)]  # threads and buffers of 40 connections, once
    for sock in warm:
        sock.sendall(pack_header(Op.PING, 1, 0, 0))
        read_reply(sock)
        sock.close()
    time.sleep(0.5)
    before = node.rss_anon()
    with TcpConnection(node.address) as conn:
        max_table = conn.info().get("max_table_bytes", 4 * MiB)
    hostile = []
    try:
        for i in range(20):  # a table just within max_table_bytes: read as it arrives
            sock = node.tcp()
            sock.sendall(pack_header(Op.GET, i, 65536, max_table) + key_entry(key(f"t{i}")) * 8)
            hostile.append(sock)
        for i in range(20):  # a PUT whose payload never comes
            sock = node.tcp()
            entry = put_entry(key(f"p{i}"), 0, MAX_BLOCK, 0)
            sock.sendall(pack_header(Op.PUT, i, 1, len(entry) + MAX_BLOCK) + entry + b"x" * 1024)
            hostile.append(sock)
        for i in range(20):  # RELEASE and COMMIT bodies sized by their counts alone
            sock = node.tcp()
            sock.sendall(pack_header(Op.RELEASE, i, 65536, 8 * 65536, flags=FLAG_NO_REPLY) + bytes(8))
            hostile.append(sock)
        serves(node, "during")
        grown = _peak_rss(node) - before
        serves(node, "still")
        assert grown <= 8 * MiB, f"node RSS grew by {grown / MiB:.1f} MiB"
    finally:
        for sock in hostile:
            sock.close()


def test_a_table_past_max_table_bytes_is_refused_at_once(node):
    """20 connections announcing a 32 MiB key table: each is refused at its header
    (FRAME_TOO_LARGE), none costs the node its size."""
    before = node.rss_anon()
    socks = [node.tcp() for _ in range(20)]
    try:
        for i, sock in enumerate(socks):
            sock.sendall(pack_header(Op.GET, i, 65536, 32 * MiB))
        for sock in socks:
            assert "max_table_bytes" in expect_error(sock, Status.FRAME_TOO_LARGE)
        assert node.rss_anon() - before <= 8 * MiB
    finally:
        for sock in socks:
            sock.close()
    serves(node)


# -- same-host ops ------------------------------------------------------------------------------
def reserve_frame(request_id: int, sizes: list[int], flags: int = 0, name: str = "r") -> bytes:
    table = b"".join(
        RESERVE_ENTRY.pack(2, 16, 0, size) + b"ns" + key(f"{name}{request_id}-{i}")[1] for i, size in enumerate(sizes)
    )
    return pack_header(Op.RESERVE, request_id, len(sizes), len(table), flags=flags) + table


@pytest.mark.parametrize("op", sorted(["RESERVE", "COMMIT", "STORE", "LEASE"]))
def test_ops_that_hold_node_memory_are_refused_over_tcp(node, op):
    frames = {
        "RESERVE": reserve_frame(1, [MiB]),
        "COMMIT": pack_header(Op.COMMIT, 1, 1, 16, flags=FLAG_REGRANT) + bytes(16),
        "STORE": pack_header(Op.STORE, 1, 1, 8 + PUT_ENTRY.size + 18, flags=FLAG_REGRANT)
        + bytes(8)
        + put_entry(key("s"), 0, MiB, 0),
        "LEASE": pack_header(Op.LEASE, 1, 1, len(key_entry(key("l")))) + key_entry(key("l")),
    }
    with node.tcp() as sock:
        sock.sendall(frames[op])
        assert "same host" in expect_error(sock, Status.SAME_HOST_ONLY)
    error = error_for(Status.SAME_HOST_ONLY)
    assert isinstance(error, ProtocolError) and error.status == Status.SAME_HOST_ONLY
    serves(node)


def test_shm_writes_over_tcp_raise_a_typed_error(node):
    with ShmConnection(node.address) as conn:  # same machine, but not through the Unix socket
        with pytest.raises(ProtocolError) as raised:
            conn.put(key("shm-over-tcp"), b"v" * 4096)
        assert raised.value.status == Status.SAME_HOST_ONLY


def test_reservations_over_the_unix_socket_stay_under_the_cap(node):
    """One same-host client reserving and never committing holds at most the grant cap
    (1/8 of DRAM) plus one frame node-wide; a second gets nothing more; all of it is given
    back with the connections, and same-host puts work throughout (sent over the socket while
    the cap is spent)."""
    held, socks = 0, [node.unix(), node.unix()]
    try:
        for n, sock in enumerate(socks):
            for request_id in range(1, 200):
                sock.sendall(reserve_frame(request_id, [MAX_BLOCK], name=f"c{n}-"))
                _, status, _, body = read_reply(sock)
                assert status == Status.OK
                if body[8] != Status.OK:
                    assert body[8] == Status.SAME_HOST_FULL  # the space is held, not DRAM full
                    break
                held += MAX_BLOCK
            else:
                raise AssertionError("reservations never ran out")
        assert GRANT_CAP <= held <= GRANT_CAP + MAX_FRAME
        with ShmConnection(node.unix_path) as conn:  # no same-host space left: puts go over the socket
            conn.put(key("shm-while-capped"), b"s" * 4096)
            assert conn.get(key("shm-while-capped")) == b"s" * 4096
            batch = [(key(f"shm-batch-while-capped-{i}"), os.urandom(MiB)) for i in range(8)]
            assert conn.put_many(batch) == [None] * len(batch)
            assert conn.get_many([k for k, _ in batch]) == [v for _, v in batch]
        serves(node, "capped")
    finally:
        for sock in socks:
            sock.close()
    value = os.urandom(MiB)

    def put_works():
        try:
            with ShmConnection(node.unix_path) as conn:
                conn.put(key("shm-after"), value)
                return conn.get(key("shm-after")) == value
        except Exception:
            return False

    wait_for(put_works)  # the connections' reservations were given back when they closed


def test_a_reserve_frame_is_bounded_by_max_frame_bytes(node):
    count = MAX_FRAME // MAX_BLOCK + 4
    with node.unix() as sock:
        sock.sendall(reserve_frame(1, [MAX_BLOCK] * count))
        _, status, _, body = read_reply(sock)
        assert status == Status.OK
        statuses = [body[8 + 9 * i] for i in range(count)]
        assert sum(s == Status.OK for s in statuses) * MAX_BLOCK <= MAX_FRAME
        assert set(statuses) - {Status.OK} <= {Status.FRAME_TOO_LARGE, Status.SAME_HOST_FULL}
        assert statuses[-1] != Status.OK
        sock.sendall(reserve_frame(2, [MAX_BLOCK] * 16, flags=FLAG_REGRANT))  # grants: the store's cap alone
        body = read_reply(sock)[3]
        assert sum(body[8 + 9 * i] == Status.OK for i in range(16)) * MAX_BLOCK <= GRANT_CAP


# -- malformed keys ---------------------------------------------------------------------------------
MALFORMED = [
    (b"", b"d" * 16),  # empty namespace
    (b"ns", b""),  # empty digest
    (b"ns", b"d" * 65),  # digest too long
    (b"n\0s", b"d" * 16),  # NUL in the namespace
    (b"\xff\xfe", b"d" * 16),  # not UTF-8
    (b"n" * 129, b"d" * 16),  # namespace too long
    (b"n" * 255, b"d" * 255),
]


def entry_of(fixed: struct.Struct, ns: bytes, digest: bytes) -> bytes:
    zeros = [0] * (len(fixed.unpack(bytes(fixed.size))) - 2)
    return fixed.pack(len(ns), len(digest), *zeros) + ns + digest


def prefix_of(op: int, sock: socket.socket, count: int) -> bytes:
    """What goes in front of an op's key table (a grant for STORE, which it needs)."""
    if op == Op.PULL:
        return bytes([len(b"127.0.0.1:9")]) + b"127.0.0.1:9"
    if op == Op.STORE:
        sock.sendall(reserve_frame(99, [4096] * count, flags=FLAG_REGRANT))
        _, status, _, body = read_reply(sock)
        assert status == Status.OK
        return body[:8]
    return b""


def test_every_op_that_carries_keys_is_classified():
    """A new op must be added to KEYED_OPS or KEYLESS_OPS (and so to the tests below)."""
    assert set(Op) - {Op.ERROR} == set(KEYED_OPS) | set(KEYLESS_OPS)
    assert not set(KEYED_OPS) & set(KEYLESS_OPS)


@pytest.mark.parametrize("transport", ["tcp", "unix"])
@pytest.mark.parametrize("op", sorted(KEYED_OPS, key=int), ids=lambda op: Op(op).name)
def test_malformed_keys_are_item_statuses_never_a_traceback(node, op, transport):
    fixed, n = KEYED_OPS[op], len(MALFORMED)
    with getattr(node, transport)() as sock:
        if transport == "tcp" and op in (Op.RESERVE, Op.STORE, Op.LEASE):
            table = b"".join(entry_of(fixed, ns, dg) for ns, dg in MALFORMED)
            sock.sendall(pack_header(op, 1, n, len(table)) + table)
            expect_error(sock, Status.SAME_HOST_ONLY)
            serves(node)
            return
        body = prefix_of(op, sock, n) + b"".join(entry_of(fixed, ns, dg) for ns, dg in MALFORMED)
        flags = FLAG_NO_REPLY if op == Op.TOUCH else 0
        sock.sendall(pack_header(op, 1, n, len(body), flags=flags) + body + pack_header(Op.PING, 2, 0, 0))
        r_op, status, count, reply = read_reply(sock)
        assert status == Status.OK, reply
        if op == Op.TOUCH:  # skipped, no reply: the next reply is the PING's
            assert r_op == Op.PING
        else:
            assert (r_op, count) == (op, n)
            if op == Op.GET:
                statuses = [reply[17 * i] for i in range(n)]
            elif op == Op.GET_RANGES:
                statuses = [reply[9 * i] for i in range(n)]
            elif op == Op.LEASE:
                statuses = [reply[8 + 25 * i] for i in range(n)]
            elif op == Op.RESERVE:
                statuses = [reply[8 + 9 * i] for i in range(n)]
            else:
                statuses = list(reply[:n])
            assert statuses == [Status.INVALID_KEY] * n
            assert read_reply(sock)[0] == Op.PING
    serves(node)


def test_touch_of_malformed_keys_with_a_reply_and_of_unknown_ones(node):
    table = b"".join(entry_of(KEY_HEAD, ns, dg) for ns, dg in MALFORMED) + key_entry(key("never-stored"))
    with node.unix() as sock:
        sock.sendall(pack_header(Op.TOUCH, 1, len(MALFORMED) + 1, len(table)) + table)
        assert read_reply(sock)[:3] == (Op.TOUCH, Status.OK, 0)


def test_no_frame_of_any_kind_makes_a_traceback(node):
    """Random headers and bodies for every op, on both sockets: each is answered or refused
    with a typed status (never INTERNAL), and the node keeps serving."""
    rng = random.Random(7)
    ops = [int(op) for op in Op] + [99]
    for transport in ("tcp", "unix"):
        for op in ops:
            for _ in range(12):
                count = rng.choice([0, 1, 2, 7, rng.randrange(65536), 65536, 65537])
                body = bytes(rng.randrange(256) for _ in range(rng.choice([0, 1, 8, 17, 64, 300])))
                if op == Op.PULL and body:
                    body = bytes([11]) + b"127.0.0.1:9" + body
                flags = rng.choice([0, FLAG_NO_REPLY, rng.randrange(1 << 16)])
                with getattr(node, transport)() as sock:
                    sock.sendall(pack_header(op, 1, count, len(body), flags=flags) + body)
                    sock.shutdown(socket.SHUT_WR)
                    try:
                        r_op, status, _, _ = read_reply(sock)
                    except (EOFError, ConnectionResetError):
                        continue  # NO_REPLY, or closed at the end of the body
                    assert status != Status.INTERNAL, (op, count, flags, body)
    serves(node)


# -- connection cap and idle timeout ------------------------------------------------------------------
@pytest.fixture
def capped_node(master, tmp_path):
    process = NodeProcess(master, tmp_path / "capped", "--max-connections", "3")
    yield process
    process.close()
    assert_no_traceback(process)


@pytest.fixture
def idle_node(master, tmp_path):
    process = NodeProcess(master, tmp_path / "idle", "--idle-timeout", "2")
    yield process
    process.close()
    assert_no_traceback(process)


def ping(sock: socket.socket, request_id: int = 1) -> None:
    sock.sendall(pack_header(Op.PING, request_id, 0, 0))
    assert read_reply(sock)[:2] == (Op.PING, Status.OK)


def test_a_connection_over_the_cap_is_refused_typed(capped_node):
    small_node = capped_node
    held = [small_node.tcp(), small_node.unix(), small_node.tcp()]
    try:
        for sock in held:
            ping(sock)  # served: all three count
        with small_node.tcp() as sock:  # one more: BUSY, then closed
            assert "busy" in expect_error(sock, Status.BUSY)
        with pytest.raises(ServiceUnavailable):
            TcpConnection(small_node.address)
        with pytest.raises(ServiceUnavailable):
            UnixConnection(small_node.unix_path)
        for sock in held:
            ping(sock, 2)  # the ones served are unaffected
    finally:
        held.pop().close()
    try:

        def admitted():
            try:
                with TcpConnection(small_node.address) as conn:
                    conn.ping()
                return True
            except ServiceUnavailable:
                return False

        wait_for(admitted)  # a slot is free again
    finally:
        for sock in held:
            sock.close()


def test_idle_connections_are_closed_and_busy_ones_are_not(idle_node):
    small_node = idle_node
    conn = TcpConnection(small_node.address)  # its last request (INFO) comes before the others connect
    assert conn.info()["idle_timeout"] == 2 and conn.info()["max_connections"] == 1024
    silent, mid_frame, busy = small_node.tcp(), small_node.unix(), small_node.tcp()
    try:
        mid_frame.sendall(pack_header(Op.GET, 1, 1, 100) + b"\x02")  # a frame that never ends
        started = time.monotonic()
        while time.monotonic() - started < 4:  # busy: a request every 0.2 s, 2 s timeout: never idle
            ping(busy)
            time.sleep(0.2)
        ping(busy)
        silent.settimeout(60)
        mid_frame.settimeout(60)
        assert closed(silent) and closed(mid_frame)  # both went idle past the timeout
        wait_for(lambda: select.select([conn._sock], [], [], 0)[0])  # closed by the node too
        with pytest.raises(TransportError):  # which the SDK reports as a TransportError
            conn.ping()
    finally:
        for sock in (silent, mid_frame, busy):
            sock.close()
        conn.close()


def test_flags_are_checked_and_documented():
    from click.testing import CliRunner

    from kvstore.cli import main

    for command in ("node", "up"):
        text = CliRunner().invoke(main, [command, "--help"]).output
        for flag in ("--max-connections", "--idle-timeout", "--max-table"):
            assert flag in text
    result = CliRunner().invoke(main, ["node", "--max-connections", "0"])
    assert result.exit_code != 0
    spec = open(os.path.join(ROOT, "proto", "dataplane.md")).read()
    for word in ("SAME_HOST_ONLY", "BUSY", "max_table_bytes", "idle_timeout", "max_connections"):
        assert word in spec
