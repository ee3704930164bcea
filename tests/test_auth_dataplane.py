"""Data-plane authentication (kvstore.transport.auth, Connection.admitted) from raw sockets.

A real master and node (``kvstore master|node --auth FILE``), the node's stderr in a file:
before AUTH every op (and an unknown one) is an ERROR UNAUTHENTICATED and the connection
closes, on TCP and on the Unix socket; a wrong proof and an unknown key id fail at the proof;
a malformed AUTH body is BAD_FRAME, never a traceback. With a tenant's token every keyed op
naming another tenant's namespace answers PERMISSION_DENIED items and leaves the victim's block
as it was; PULL is refused to tenants. A node without an access file answers hello with an
empty body and serves as before.
"""

from __future__ import annotations

import os
import socket
import struct

import pytest
import xxhash

from kvstore.node.config import StoreConfig
from kvstore.node.store import BlockStore
from kvstore.transport.server import DataPlaneServer
from kvstore_client.auth import HELLO_BYTES, NODE_NONCE_BYTES, PROOF_BYTES, DataKey, Handshake
from kvstore_client.credentials import Credentials
from kvstore_client.errors import PermissionDenied, Unauthenticated
from kvstore_client.transport import TcpConnection, UnixConnection
from kvstore_client.wire import (
    FLAG_NO_REPLY,
    FLAG_REGRANT,
    GET_ITEM,
    HEADER,
    KEY_HEAD,
    KEYED_OPS,
    KEYLESS_OPS,
    LEASE_ITEM,
    PULL_ENTRY,
    RESERVE_ENTRY,
    RESERVED_ITEM,
    U64,
    Op,
    Status,
    key_entry,
    pack_header,
    put_entry,
)
from tests.access_files import ADMIN, NODE, NS_A, NS_B, TENANT_A, TENANT_B, WRONG, write_access_file
from tests.processes import start_master
from tests.test_transport_limits import NodeProcess, assert_no_traceback, closed, expect_error, read_reply

KiB = 1 << 10
DENIED = Status.PERMISSION_DENIED
UNKNOWN_OPS = (0, 99)  # ERROR (reply only) and an op no one defined


@pytest.fixture(scope="module")
def access_file(tmp_path_factory):
    return write_access_file(tmp_path_factory.mktemp("access"))


@pytest.fixture(scope="module")
def master(access_file):
    service = start_master(ttl=30.0, extra=("--auth", str(access_file)))
    yield service.record["master"]
    service.close()


@pytest.fixture(scope="module")
def node(master, access_file, tmp_path_factory):
    process = NodeProcess(master, tmp_path_factory.mktemp("authnode"), "--auth", str(access_file))
    yield process
    process.close()


@pytest.fixture(autouse=True)
def no_tracebacks(request):
    """No frame, however malformed or unauthenticated, may make the node log a traceback."""
    yield
    if "node" in request.fixturenames:
        assert_no_traceback(request.getfixturevalue("node"))


def digest(name: str) -> bytes:
    return xxhash.xxh3_128_digest(name.encode())


VICTIM = (NS_B, digest("victim"))
VICTIM_VALUE = os.urandom(64 * KiB)


@pytest.fixture(scope="module")
def victim(node):
    """Tenant B's block, stored with B's token; each test checks it is still exactly there."""
    with TcpConnection(node.address, credentials=Credentials(TENANT_B)) as conn:
        conn.put(VICTIM, VICTIM_VALUE)
    yield VICTIM
    with TcpConnection(node.address, credentials=Credentials(TENANT_B)) as conn:
        assert conn.get(VICTIM) == VICTIM_VALUE


def assert_intact(node) -> None:
    """Tenant B's block is exactly as B stored it."""
    with TcpConnection(node.address, credentials=Credentials(TENANT_B)) as conn:
        assert conn.get(VICTIM) == VICTIM_VALUE


def open_sock(node, transport: str) -> socket.socket:
    return node.tcp() if transport == "tcp" else node.unix()


def authenticate(sock: socket.socket, token: str) -> str:
    """The client's half of AUTH over a raw socket; the token's name as the node knows it."""
    handshake = Handshake(DataKey.of_token(token))
    sock.sendall(pack_header(Op.AUTH, 1, 0, HELLO_BYTES) + handshake.hello())
    op, status, _, body = read_reply(sock)
    assert (op, status, len(body)) == (Op.AUTH, Status.OK, NODE_NONCE_BYTES)
    sock.sendall(pack_header(Op.AUTH, 2, 0, PROOF_BYTES) + handshake.challenge(body))
    op, status, _, body = read_reply(sock)
    assert (op, status) == (Op.AUTH, Status.OK), body
    return handshake.accepted(body)


def ping(sock: socket.socket, request_id: int = 77) -> None:
    sock.sendall(pack_header(Op.PING, request_id, 0, 0))
    assert read_reply(sock)[:2] == (Op.PING, Status.OK)


def entry_of(fixed: struct.Struct, key, size: int = 0) -> bytes:
    """A table entry of layout ``fixed`` for ``key``; ``size`` where the layout has one."""
    ns, dg = key[0].encode(), key[1]
    if fixed is KEY_HEAD:
        return KEY_HEAD.pack(len(ns), len(dg)) + ns + dg
    if fixed is RESERVE_ENTRY:
        return RESERVE_ENTRY.pack(len(ns), len(dg), 0, size) + ns + dg
    if fixed is PULL_ENTRY:
        return PULL_ENTRY.pack(len(ns), len(dg), 0) + ns + dg
    return put_entry(key, 0, size, xxhash.xxh3_64_intdigest(b"\0" * size))


def request_of(op: int, key) -> bytes:
    """One plausible, complete request frame of ``op`` naming ``key`` (keyed ops)."""
    if op in (Op.PUT,):
        payload = b"\0" * 4096
        body = entry_of(KEYED_OPS[op], key, len(payload)) + payload
    elif op == Op.STORE:
        body = bytes(8) + entry_of(KEYED_OPS[op], key, 4096)
    elif op == Op.PULL:
        source = b"127.0.0.1:9"
        body = bytes([len(source)]) + source + entry_of(PULL_ENTRY, key)
    elif op in KEYED_OPS:
        body = entry_of(KEYED_OPS[op], key, 4096)
    elif op in (Op.RELEASE,):
        body = U64.pack(1)
    elif op == Op.COMMIT:
        body = U64.pack(1) + U64.pack(0)
    else:
        body = b""
    count = 0 if op in (Op.PING, Op.INFO) or op in UNKNOWN_OPS else 1
    return pack_header(op, 5, count, len(body)) + body


PRE_AUTH_OPS = sorted((set(KEYED_OPS) | set(KEYLESS_OPS)) - {Op.AUTH}) + list(UNKNOWN_OPS)


def test_the_op_table_is_what_this_file_covers():
    """A new op lands in KEYED_OPS or KEYLESS_OPS and so in the tests below."""
    assert set(Op) - {Op.ERROR} == set(KEYED_OPS) | set(KEYLESS_OPS)


# -- before AUTH ---------------------------------------------------------------------------------
@pytest.mark.parametrize("transport", ["tcp", "unix"])
@pytest.mark.parametrize("op", PRE_AUTH_OPS, ids=lambda op: Op(op).name if op in set(Op) else f"op{op}")
def test_every_op_before_auth_is_unauthenticated_and_closes(node, victim, op, transport):
    with open_sock(node, transport) as sock:
        sock.sendall(request_of(op, victim))
        message = expect_error(sock, Status.UNAUTHENTICATED)
        assert "AUTH" in message or "token" in message
    assert_intact(node)


def test_a_second_frame_after_the_refusal_is_never_served(node, victim):
    """Pipelined frames behind the refused one die with the connection: REMOVE never runs."""
    with node.unix() as sock:
        sock.sendall(request_of(Op.EXISTS, victim) + request_of(Op.REMOVE, victim) + request_of(Op.PUT, victim))
        expect_error(sock, Status.UNAUTHENTICATED)
    assert_intact(node)


def test_the_sdk_without_a_token_is_refused_typed(node):
    for connect in (lambda: TcpConnection(node.address), lambda: UnixConnection(node.unix_path)):
        with pytest.raises(Unauthenticated):
            connect()


# -- the proof ------------------------------------------------------------------------------------
@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_a_proof_under_the_wrong_key_is_unauthenticated(node, transport):
    """Tenant A's key id, but a proof by someone who does not hold A's token."""
    with open_sock(node, transport) as sock:
        real, forger = DataKey.of_token(TENANT_A), DataKey.of_token(WRONG)
        nonce = os.urandom(16)
        sock.sendall(pack_header(Op.AUTH, 1, 0, HELLO_BYTES) + real.key_id + nonce)
        op, status, _, challenge = read_reply(sock)
        assert (op, status, len(challenge)) == (Op.AUTH, Status.OK, NODE_NONCE_BYTES)
        sock.sendall(pack_header(Op.AUTH, 2, 0, PROOF_BYTES) + forger.client_proof(nonce, challenge))
        expect_error(sock, Status.UNAUTHENTICATED)


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_an_unknown_key_id_fails_at_the_proof_not_at_hello(node, transport):
    """The hello of a key id the file does not hold is answered like any other (no probing
    which ids exist); the proof then fails."""
    with open_sock(node, transport) as sock:
        handshake = Handshake(DataKey.of_token(WRONG))
        sock.sendall(pack_header(Op.AUTH, 1, 0, HELLO_BYTES) + handshake.hello())
        op, status, _, challenge = read_reply(sock)
        assert (op, status, len(challenge)) == (Op.AUTH, Status.OK, NODE_NONCE_BYTES)
        sock.sendall(pack_header(Op.AUTH, 2, 0, PROOF_BYTES) + handshake.challenge(challenge))
        expect_error(sock, Status.UNAUTHENTICATED)


def test_the_sdk_with_a_wrong_token_is_refused_typed(node):
    for connect in (
        lambda: TcpConnection(node.address, credentials=Credentials(WRONG)),
        lambda: UnixConnection(node.unix_path, credentials=Credentials(WRONG)),
    ):
        with pytest.raises(Unauthenticated):
            connect()


def test_each_token_proves_its_name(node):
    for token, name in ((TENANT_A, "acme"), (TENANT_B, "globex"), (ADMIN, "root"), (NODE, "storage")):
        with node.tcp() as sock:
            assert authenticate(sock, token) == name
            ping(sock)


MALFORMED_AUTH = {
    "empty hello": lambda sock: pack_header(Op.AUTH, 1, 0, 0),
    "short hello": lambda sock: pack_header(Op.AUTH, 1, 0, 5) + b"12345",
    "long hello": lambda sock: pack_header(Op.AUTH, 1, 0, HELLO_BYTES + 1) + bytes(HELLO_BYTES + 1),
    "not a frame": lambda sock: b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
}
OVERSIZED_AUTH = {  # refused by the frame limits, before AUTH reads a byte of body
    "huge body_len": lambda sock: pack_header(Op.AUTH, 1, 0, 1 << 40) + bytes(64),
    "huge count": lambda sock: pack_header(Op.AUTH, 1, 0xFFFFFFFF, HELLO_BYTES) + bytes(HELLO_BYTES),
}


@pytest.mark.parametrize("transport", ["tcp", "unix"])
@pytest.mark.parametrize("case", sorted(MALFORMED_AUTH) + sorted(OVERSIZED_AUTH))
def test_a_malformed_hello_is_bad_frame(node, case, transport):
    with open_sock(node, transport) as sock:
        if case in OVERSIZED_AUTH:
            sock.sendall(OVERSIZED_AUTH[case](sock))
            expect_error(sock, Status.FRAME_TOO_LARGE)
        else:
            sock.sendall(MALFORMED_AUTH[case](sock))
            expect_error(sock, Status.BAD_FRAME)


@pytest.mark.parametrize("proof_len", [0, PROOF_BYTES - 1, PROOF_BYTES + 1, HELLO_BYTES + 1])
def test_a_malformed_proof_is_bad_frame(node, proof_len):
    with node.tcp() as sock:
        handshake = Handshake(DataKey.of_token(TENANT_A))
        sock.sendall(pack_header(Op.AUTH, 1, 0, HELLO_BYTES) + handshake.hello())
        read_reply(sock)
        sock.sendall(pack_header(Op.AUTH, 2, 0, proof_len) + bytes(proof_len))
        expect_error(sock, Status.BAD_FRAME)


def test_auth_again_on_an_authenticated_connection_is_bad_frame(node):
    with node.unix() as sock:
        authenticate(sock, TENANT_A)
        sock.sendall(pack_header(Op.AUTH, 3, 0, HELLO_BYTES) + Handshake(DataKey.of_token(ADMIN)).hello())
        expect_error(sock, Status.BAD_FRAME)


def test_a_cut_off_handshake_leaves_no_traceback(node):
    for cut in (3, HEADER.size, HEADER.size + 7):
        with node.tcp() as sock:
            sock.sendall((pack_header(Op.AUTH, 1, 0, HELLO_BYTES) + bytes(HELLO_BYTES))[:cut])
            sock.shutdown(socket.SHUT_WR)
            assert closed(sock)


# -- a tenant's token, another tenant's namespace ---------------------------------------------------
def tenant_sock(node, transport: str, token: str = TENANT_A) -> socket.socket:
    sock = open_sock(node, transport)
    authenticate(sock, token)
    return sock


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_get_of_another_tenants_block_is_denied_and_sends_no_bytes(node, victim, transport):
    own = (NS_A, digest(f"own-get-{transport}"))
    with TcpConnection(node.address, credentials=Credentials(TENANT_A)) as conn:
        conn.put(own, b"a" * 1000)
    with tenant_sock(node, transport) as sock:
        table = key_entry(victim) + key_entry(own)
        sock.sendall(pack_header(Op.GET, 9, 2, len(table)) + table)
        op, status, count, body = read_reply(sock)
        assert (op, status, count) == (Op.GET, Status.OK, 2)
        (s1, size1, _), (s2, size2, _) = GET_ITEM.unpack_from(body, 0), GET_ITEM.unpack_from(body, GET_ITEM.size)
        assert (s1, size1) == (DENIED, 0)
        assert (s2, size2) == (Status.OK, 1000)
        assert body[2 * GET_ITEM.size :] == b"a" * 1000  # only A's bytes
        ping(sock)


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_put_over_another_tenants_block_is_denied_drained_and_the_connection_serves_on(node, victim, transport):
    own = (NS_A, digest(f"own-put-{transport}"))
    forged, mine = os.urandom(48 * KiB), os.urandom(8 * KiB)
    with tenant_sock(node, transport) as sock:
        body = (
            put_entry(victim, 0, len(forged), xxhash.xxh3_64_intdigest(forged))
            + put_entry(own, 0, len(mine), xxhash.xxh3_64_intdigest(mine))
            + forged
            + mine
        )
        sock.sendall(pack_header(Op.PUT, 3, 2, len(body)) + body)
        assert read_reply(sock) == (Op.PUT, Status.OK, 2, bytes([DENIED, Status.OK]))
        ping(sock)  # the forged payload was drained, not read as the next frame
        table = key_entry(own)
        sock.sendall(pack_header(Op.GET, 4, 1, len(table)) + table)
        _, status, _, reply = read_reply(sock)
        assert status == Status.OK and reply[GET_ITEM.size :] == mine
    assert_intact(node)


@pytest.mark.parametrize("transport", ["tcp", "unix"])
@pytest.mark.parametrize("op", [Op.EXISTS, Op.REMOVE, Op.VERIFY])
def test_status_ops_on_another_tenants_block_are_denied(node, victim, op, transport):
    with tenant_sock(node, transport) as sock:
        table = key_entry(victim) * 3
        sock.sendall(pack_header(op, 6, 3, len(table)) + table)
        assert read_reply(sock) == (op, Status.OK, 3, bytes([DENIED] * 3))
        ping(sock)
    assert_intact(node)


def test_lease_of_another_tenants_block_is_denied(node, victim):
    with tenant_sock(node, "unix") as sock:
        table = key_entry(victim)
        sock.sendall(pack_header(Op.LEASE, 7, 1, len(table)) + table)
        op, status, count, body = read_reply(sock)
        assert (op, status, count) == (Op.LEASE, Status.OK, 1)
        assert U64.unpack_from(body)[0] == 0  # nothing leased
        assert LEASE_ITEM.unpack_from(body, U64.size) == (DENIED, 0, 0, 0)
        ping(sock)


def test_reserve_for_another_tenants_key_is_denied(node, victim):
    with tenant_sock(node, "unix") as sock:
        table = entry_of(RESERVE_ENTRY, victim, 4096)
        sock.sendall(pack_header(Op.RESERVE, 8, 1, len(table)) + table)
        op, status, count, body = read_reply(sock)
        assert (op, status, count) == (Op.RESERVE, Status.OK, 1)
        assert U64.unpack_from(body)[0] == 0  # nothing reserved
        assert RESERVED_ITEM.unpack_from(body, U64.size)[0] == DENIED
        ping(sock)


def test_store_into_another_tenants_key_is_denied(node, victim):
    with tenant_sock(node, "unix") as sock:
        own = (NS_A, digest("grant"))
        table = entry_of(RESERVE_ENTRY, own, 4096)
        # a grant (REGRANT) is bound to no key: STORE names it
        sock.sendall(pack_header(Op.RESERVE, 2, 1, len(table), flags=FLAG_REGRANT) + table)
        op, status, _, body = read_reply(sock)
        assert (op, status) == (Op.RESERVE, Status.OK)
        grant_id = U64.unpack_from(body)[0]
        assert grant_id and RESERVED_ITEM.unpack_from(body, U64.size)[0] == Status.OK
        store = U64.pack(grant_id) + put_entry(victim, 0, 4096, xxhash.xxh3_64_intdigest(bytes(4096)))
        sock.sendall(pack_header(Op.STORE, 3, 1, len(store)) + store)
        assert read_reply(sock) == (Op.STORE, Status.OK, 1, bytes([DENIED]))
        ping(sock)
    assert_intact(node)


def test_touch_skips_another_tenants_keys(node, victim):
    with tenant_sock(node, "unix") as sock:
        table = key_entry(victim)
        sock.sendall(pack_header(Op.TOUCH, 1, 1, len(table), flags=FLAG_NO_REPLY) + table)
        sock.sendall(pack_header(Op.TOUCH, 2, 1, len(table)) + table)
        assert read_reply(sock)[:3] == (Op.TOUCH, Status.OK, 0)
        ping(sock)


@pytest.mark.parametrize("transport", ["tcp", "unix"])
@pytest.mark.parametrize("namespace", [NS_A, NS_B])
def test_pull_is_refused_to_tenants(node, namespace, transport):
    with tenant_sock(node, transport) as sock:
        sock.sendall(request_of(Op.PULL, (namespace, digest("pulled"))))
        assert "tenant" in expect_error(sock, DENIED)


def test_the_owner_and_the_admin_still_reach_the_victim(node, victim):
    for token in (TENANT_B, ADMIN):
        with tenant_sock(node, "tcp", token) as sock:
            table = key_entry(victim)
            sock.sendall(pack_header(Op.GET, 1, 1, len(table)) + table)
            _, status, _, body = read_reply(sock)
            assert status == Status.OK and GET_ITEM.unpack_from(body)[0] == Status.OK
            assert body[GET_ITEM.size :] == VICTIM_VALUE


def test_the_sdk_raises_permission_denied_for_another_tenants_keys(node, victim):
    for conn in (
        TcpConnection(node.address, credentials=Credentials(TENANT_A)),
        UnixConnection(node.unix_path, credentials=Credentials(TENANT_A)),
    ):
        with conn:
            with pytest.raises(PermissionDenied):
                conn.get(victim)
            with pytest.raises(PermissionDenied):
                conn.put(victim, b"overwritten")
            own = (NS_A, digest("sdk-own"))
            conn.put(own, b"still usable")
            assert conn.get(own) == b"still usable"
    assert_intact(node)


# -- a node without an access file ----------------------------------------------------------------
def test_a_node_without_an_access_file_answers_hello_empty_and_serves(tmp_path):
    with BlockStore(StoreConfig(dram_capacity=8 << 20, max_block_bytes=1 << 20)) as store:
        server = DataPlaneServer(store, unix_path=str(tmp_path / "open.sock")).start()
        try:
            host, port = server.address.rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=30) as sock:
                sock.sendall(pack_header(Op.AUTH, 1, 0, HELLO_BYTES) + Handshake(DataKey.of_token(TENANT_A)).hello())
                assert read_reply(sock) == (Op.AUTH, Status.OK, 0, b"")
                ping(sock)
            with socket.create_connection((host, int(port)), timeout=30) as sock:
                ping(sock)  # no AUTH at all: served as before
            key = (NS_B, digest("open"))
            for conn in (
                TcpConnection(server.address, credentials=Credentials(TENANT_A)),
                UnixConnection(server.unix_path, credentials=Credentials(TENANT_A)),
                TcpConnection(server.address),
            ):
                with conn:
                    conn.put(key, b"anyone")  # no tokens checked: no namespaces either
                    assert conn.get(key) == b"anyone"
        finally:
            server.stop()


def test_a_tenant_is_not_given_the_block_directory(node):
    """One-sided reads through the node's block directory would skip the namespace check (it
    lists every tenant's blocks): INFO names it to admins and nodes, not to tenants."""
    import json

    def info(token: str) -> dict:
        with tenant_sock(node, "unix", token) as sock:
            sock.sendall(pack_header(Op.INFO, 1, 0, 0))
            op, status, _, body = read_reply(sock)
            assert (op, status) == (Op.INFO, Status.OK)
            return json.loads(body)

    assert info(ADMIN)["directory"] and info(NODE)["directory"]
    assert info(TENANT_A)["directory"] is None and info(TENANT_B)["directory"] is None
    assert info(TENANT_A)["arena"] == info(ADMIN)["arena"]  # shared memory itself still serves writes
