"""Connections that never authenticate, on every listener of a service with an access file.

The attack of the finding: many connections that each send a byte now and then and never
finish authenticating. A per-recv timeout never fires on them, so they used to hold every
slot: authenticated clients were turned away (BUSY) and the connections stayed for good.
Now a connection has ``auth_timeout`` seconds in all to authenticate, at most
``max_unauthenticated`` wait at once (a new one drops the oldest), and they never take a
slot an authenticated client needs (kvstore.transport.limits.PendingConnections).

Real servers in this process on 127.0.0.1 ports chosen at run time, raw sockets for the
attacker and the SDK for the clients: the node's data plane (DataPlaneServer), the master's
conductor port (ConductorPort) and its gRPC port (a metrics token is refused there, as on
the data plane and the conductor port). The metrics port's own bounds are in
tests/test_master_metrics.py.
"""

from __future__ import annotations

import select
import socket
import threading
import time

import pytest

from kvstore.master.conductor_port import ConductorPort
from kvstore.master.server import MasterServer
from kvstore.node.config import ConnectionLimits, StoreConfig
from kvstore.node.store import BlockStore
from kvstore.security.access import AccessList
from kvstore.transport.server import DataPlaneServer
from kvstore_client import Client
from kvstore_client.auth import HELLO_BYTES
from kvstore_client.conductor_wire import MAX_TOKEN_BYTES, Method, Status, pack_header
from kvstore_client.credentials import Credentials
from kvstore_client.errors import PermissionDenied
from kvstore_client.transport import TcpConnection
from kvstore_client.wire import Op
from kvstore_client.wire import pack_header as pack_frame_header
from tests.access_files import ACCESS_TOML, ADMIN, NS_A, TENANT_A, write_access_file
from tests.processes import wait_for
from tests.test_conductor_port import closed, keys, raw, read_reply, run, with_engines, with_link

KiB, MiB = 1 << 10, 1 << 20
METRICS = "metrics-token-0123456789abcdef"  # may scrape, nothing else
METRICS_TOML = f"""
[tokens.prometheus]
secret = "{METRICS}"
role = "metrics"
"""
AUTH_TIMEOUT = 1.0  # seconds: short, so the deadlines fall due within the test
PERIOD = 0.3  # seconds between a trickler's bytes: far under any per-recv timeout
MAX_UNAUTHENTICATED, MAX_CONNECTIONS = 8, 16
GENEROUS = 20.0  # seconds: liveness only, never a measured bound


def access_with_metrics(directory) -> AccessList:
    """The tests' access file (tests/access_files.py) plus a metrics token."""
    return AccessList.load(str(write_access_file(directory, ACCESS_TOML + METRICS_TOML)))


class Tricklers:
    """``count`` raw connections to ``address``, each sent one byte of ``message`` every PERIOD
    seconds (never a whole frame), from one thread; ``closed`` counts those the server closed."""

    def __init__(self, address: str, count: int, message: bytes):
        host, port = address.rsplit(":", 1)
        self.socks = [socket.create_connection((host, int(port)), timeout=GENEROUS) for _ in range(count)]
        self.message = message
        self._gone: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._trickle, daemon=True)
        self._thread.start()

    @property
    def closed(self) -> int:
        return len(self._gone)

    def all_closed(self) -> bool:
        return self.closed == len(self.socks)

    def _trickle(self) -> None:
        sent = 0
        while not self._stop.wait(PERIOD):
            byte = self.message[sent % len(self.message) : sent % len(self.message) + 1]
            sent += 1
            for i, sock in enumerate(self.socks):
                if i not in self._gone and (self._ended(sock) or not self._send(sock, byte)):
                    self._gone.add(i)

    @staticmethod
    def _send(sock: socket.socket, byte: bytes) -> bool:
        try:
            sock.send(byte)
            return True
        except OSError:
            return False

    @staticmethod
    def _ended(sock: socket.socket) -> bool:
        """Whether the server closed ``sock`` (EOF or reset); reads what it sent (a BUSY frame)."""
        while select.select([sock], [], [], 0)[0]:
            try:
                if not sock.recv(65536):
                    return True
            except OSError:
                return True
        return False

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for sock in self.socks:
            sock.close()


# -- the node's data plane --------------------------------------------------------------------------
# An AUTH hello, a byte at a time: a whole exchange (two frames of 24 + 32 bytes) would take a
# trickler over 30 s, longer than GENEROUS, so only a deadline closes it within the test.
HELLO = pack_frame_header(Op.AUTH, 1, 0, HELLO_BYTES) + bytes(HELLO_BYTES)


@pytest.fixture
def access(tmp_path):
    return access_with_metrics(tmp_path / "access")


@pytest.fixture
def node(access):
    limits = ConnectionLimits(
        max_connections=MAX_CONNECTIONS, auth_timeout=AUTH_TIMEOUT, max_unauthenticated=MAX_UNAUTHENTICATED
    )
    store = BlockStore(StoreConfig(dram_capacity=8 * MiB, max_block_bytes=MiB, connections=limits))
    server = DataPlaneServer(store, node_id="preauth", access=access).start()
    yield server
    server.stop()
    store.close()


def round_trip(conn: TcpConnection, name: bytes) -> None:
    key, value = (NS_A, name.ljust(16, b".")), name * 1024
    conn.put(key, value)
    assert conn.get(key) == value


def test_data_plane_closes_trickling_connections_at_the_auth_deadline(node):
    """As many tricklers as may wait (none is dropped for a newer one): each is closed at its
    deadline, though a byte arrives every PERIOD seconds."""
    tricklers = Tricklers(node.address, MAX_UNAUTHENTICATED, HELLO)
    try:
        wait_for(tricklers.all_closed, timeout=GENEROUS)
        wait_for(lambda: node.connections == 0, timeout=GENEROUS)
    finally:
        tricklers.close()


def test_data_plane_serves_authenticated_clients_through_a_flood_of_tricklers(node):
    settled = TcpConnection(node.address, credentials=Credentials(TENANT_A), timeout=GENEROUS)
    tricklers = Tricklers(node.address, 4 * MAX_CONNECTIONS, HELLO)
    try:
        assert node.connections <= MAX_CONNECTIONS + 1  # the tricklers hold the waiting slots, no more
        with TcpConnection(node.address, credentials=Credentials(TENANT_A), timeout=GENEROUS) as newcomer:
            round_trip(newcomer, b"newcomer")  # not BUSY: it took the place of the oldest trickler
        round_trip(settled, b"settled")  # one authenticated earlier is untouched
        wait_for(tricklers.all_closed, timeout=GENEROUS)
        time.sleep(AUTH_TIMEOUT)  # past the deadline: an authenticated connection has none
        round_trip(settled, b"after")
    finally:
        tricklers.close()
        settled.close()


def test_data_plane_refuses_a_metrics_token(node):
    with pytest.raises(PermissionDenied, match="metrics"):
        TcpConnection(node.address, credentials=Credentials(METRICS), timeout=GENEROUS)


def test_data_plane_without_an_access_file_has_no_authentication_phase():
    """No tokens checked: no deadline, no separate count; a slow client is bounded only by
    idle_timeout, as before."""
    limits = ConnectionLimits(auth_timeout=0.2, max_unauthenticated=1, idle_timeout=60)
    with BlockStore(StoreConfig(dram_capacity=4 * MiB, max_block_bytes=MiB, connections=limits)) as store:
        with DataPlaneServer(store).start() as server:
            assert server.unauthenticated is None
            with TcpConnection(server.address, timeout=GENEROUS) as first, TcpConnection(server.address) as second:
                time.sleep(0.5)  # past auth_timeout: it does not apply here
                first.ping()
                second.ping()


# -- the master's conductor port and gRPC port ----------------------------------------------------
@pytest.fixture
def master(access):
    with MasterServer(access=access) as m:
        with_engines(m, NS_A, token=ADMIN)
        yield m


@pytest.fixture
def conductor_port(master, access):
    port = ConductorPort.open(
        master.conductor,
        lambda *_: None,
        "127.0.0.1",
        0,
        access=access,
        max_connections=MAX_CONNECTIONS,
        auth_timeout=AUTH_TIMEOUT,
        max_unauthenticated=MAX_UNAUTHENTICATED,
    )
    yield port
    port.stop()


# An AUTH frame with the longest token there may be, a byte at a time: never whole within the test.
AUTH_HEADER = pack_header(Method.AUTH, 1, MAX_TOKEN_BYTES) + b"t" * MAX_TOKEN_BYTES


def schedules(port: ConductorPort, token: str = ADMIN) -> str:
    where = run(with_link(port.address, lambda link: link.schedule(keys(namespace=NS_A), 32, 1), token=token))
    return where.prefill_engine


def test_conductor_port_closes_trickling_connections_at_the_auth_deadline(conductor_port):
    tricklers = Tricklers(conductor_port.address, MAX_UNAUTHENTICATED, AUTH_HEADER)
    try:
        wait_for(tricklers.all_closed, timeout=GENEROUS)
        wait_for(lambda: conductor_port.connections() == 0, timeout=GENEROUS)
    finally:
        tricklers.close()


def test_conductor_port_serves_authenticated_callers_through_a_flood_of_tricklers(conductor_port):
    tricklers = Tricklers(conductor_port.address, 4 * MAX_CONNECTIONS, AUTH_HEADER)
    try:
        assert conductor_port.connections() <= MAX_CONNECTIONS + 1
        assert schedules(conductor_port) == "P"  # not BUSY: it took the place of the oldest trickler
        wait_for(tricklers.all_closed, timeout=GENEROUS)
        assert schedules(conductor_port) == "P"
    finally:
        tricklers.close()


def test_conductor_port_refuses_a_metrics_token(conductor_port):
    sock = raw(conductor_port)
    sock.sendall(pack_header(Method.AUTH, 7, len(METRICS)) + METRICS.encode())
    status, request_id, body = read_reply(sock)
    assert (status, request_id) == (Status.PERMISSION_DENIED, 7) and b"metrics" in body
    assert closed(sock)


def test_grpc_refuses_a_metrics_token(master):
    with Client(master.address, token=METRICS, timeout=GENEROUS) as client:
        with pytest.raises(PermissionDenied):
            client.cluster_status()


def test_kvstore_token_makes_a_metrics_token():
    from click.testing import CliRunner

    from kvstore.cli import main

    result = CliRunner().invoke(main, ["token", "prom", "--role", "metrics"])
    assert result.exit_code == 0, result.output
    assert 'role = "metrics"' in result.output
    assert CliRunner().invoke(main, ["token", "prom", "--role", "metrics", "--namespace", "x"]).exit_code != 0
