"""The master's conductor port (kvstore.master.conductor_port) and its client (kvstore_client.conductor_link).

In-process masters on loopback ports chosen at run time. The port answers as gRPC does (the
same conductor, the same rejection reasons, the same roles and namespaces under an access
file, TLS with the master's certificate); a malformed frame gets a typed error and never
disturbs the master; ClusterStatus announces the port; the router's ConductorCalls falls
back to gRPC when there is no port or it breaks.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import time

import pytest

from kvstore.master.conductor_port import ConductorPort
from kvstore.master.conductor_service import SchedulingOptions
from kvstore.master.membership import NodeIdentity
from kvstore.master.server import MasterServer
from kvstore.router.conductor_calls import ConductorCalls
from kvstore.router.server import PoolBackend
from kvstore_client import Client
from kvstore_client.conductor_link import ConductorLink, LinkDown
from kvstore_client.conductor_wire import HEADER_SIZE, MAX_BODY_BYTES, Method, Status, pack_header, unpack_header
from kvstore_client.errors import Overloaded, PermissionDenied, ProtocolError, Unauthenticated
from kvstore_client.proto import kvstore_pb2 as pb
from kvstore.security.access import AccessList
from tests.access_files import ADMIN, NODE, NS_A, NS_B, TENANT_A, TENANT_B, WRONG, access_list

NS = "chat/layer1"


def keys(n: int = 3, namespace: str = NS):
    return [(namespace, os.urandom(32)) for _ in range(n)]


def with_engines(master: MasterServer, namespace: str = NS, **client_args) -> None:
    """A prefill and a decode engine on storage node "node-1", which joins the master first
    (engines go only on live nodes; no node process: the conductor only names it)."""
    master.membership.register(NodeIdentity("node-1"))
    with Client(master.address, **client_args) as client:
        client.scheduling.register_engine(namespace, "P", "prefill", "node-1")
        client.scheduling.register_engine(namespace, "D", "decode", "node-1")


@pytest.fixture
def master():
    with MasterServer() as m:
        with_engines(m)
        yield m


def run(coro):
    return asyncio.run(coro)


async def with_link(address: str, fn, **kwargs):
    link = ConductorLink(address, **kwargs)
    try:
        return await fn(link)
    finally:
        await link.close()


def raw(master) -> socket.socket:
    """A plain TCP connection to ``master``'s conductor port (a MasterServer or a ConductorPort)."""
    host, port = (getattr(master, "conductor_address", None) or master.address).rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    return sock


def read_reply(sock: socket.socket) -> tuple[int, int, bytes]:
    header = b""
    while len(header) < HEADER_SIZE:
        chunk = sock.recv(HEADER_SIZE - len(header))
        if not chunk:
            raise EOFError
        header += chunk
    status, request_id, n = unpack_header(header)
    body = b""
    while len(body) < n:
        body += sock.recv(n - len(body))
    return status, request_id, body


def closed(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


# -- the calls ------------------------------------------------------------------------------
def test_schedule_and_reports_over_the_port_match_the_conductor(master):
    async def calls(link):
        where = await link.schedule(keys(), 96, 8, request_id="r1", start_prefill=True)
        finished = await link.report_request(NS, "r1", "prefill_finished")
        done = await link.report_request(NS, "r1", "decode_finished")
        return where, finished, done

    where, finished, done = run(with_link(master.conductor_address, calls))
    assert (where.request_id, where.prefill_engine, where.decode_engine) == ("r1", "P", "D")
    assert where.decode_final  # the default admission rejects at arrival only
    assert finished.decode_engine == "D" and not finished.rejected
    assert done == pb.RequestEventReply()
    assert master.conductor.conductor(NS).in_flight() == 0


def test_decode_is_not_final_when_the_admission_rejects_at_decode():
    with MasterServer(scheduling=SchedulingOptions(admission="none")) as m:
        with_engines(m)
        where = run(with_link(m.conductor_address, lambda link: link.schedule(keys(), 64, 4, request_id="r")))
        assert where.decode_engine == "D" and not where.decode_final


def test_a_rejection_is_overloaded_with_its_reason():
    with MasterServer() as m:  # no engines in this namespace
        with pytest.raises(Overloaded) as err:
            run(with_link(m.conductor_address, lambda link: link.schedule(keys(), 64, 4)))
        assert err.value.reason == "no_instance"


def test_pipelined_calls_get_their_own_replies(master):
    async def calls(link):
        return await asyncio.gather(*(link.schedule(keys(), 32, 1, request_id=f"p{i}") for i in range(20)))

    replies = run(with_link(master.conductor_address, calls))
    assert [r.request_id for r in replies] == [f"p{i}" for i in range(20)]


def test_the_calls_count_in_the_master_metrics_as_the_grpc_methods(master):
    before = master.servicer.rpc_counts().get(("Schedule", "OK"), 0)
    run(with_link(master.conductor_address, lambda link: link.schedule(keys(), 32, 1, request_id="m")))
    with pytest.raises(Overloaded):
        run(with_link(master.conductor_address, lambda link: link.schedule(keys(1, "empty/ns"), 32, 1)))
    counts = master.servicer.rpc_counts()
    assert counts[("Schedule", "OK")] == before + 1 and counts[("Schedule", "RESOURCE_EXHAUSTED")] >= 1


def test_cluster_status_announces_the_port_and_none_when_off(master):
    with Client(master.address) as client:
        assert client.cluster_status().conductor_address == master.conductor_address
    with MasterServer(conductor_port=None) as m, Client(m.address) as client:
        assert m.conductor_address is None and client.cluster_status().conductor_address == ""


# -- bad input ------------------------------------------------------------------------------
def test_a_frame_with_a_bad_magic_is_refused_and_the_connection_closed(master):
    sock = raw(master)
    sock.sendall(b"XX" + pack_header(Method.SCHEDULE, 1, 0)[2:])
    status, _, body = read_reply(sock)
    assert status == Status.BAD_FRAME and b"magic" in body and closed(sock)


def test_an_oversized_body_is_refused_from_its_header(master):
    sock = raw(master)
    header = bytearray(pack_header(Method.SCHEDULE, 7, 0))
    header[8:12] = (MAX_BODY_BYTES + 1).to_bytes(4, "little")
    sock.sendall(bytes(header))  # and no body: the master must not wait for it
    status, _, body = read_reply(sock)
    assert status == Status.BAD_FRAME and b"at most" in body and closed(sock)


def test_an_unknown_method_is_refused_and_the_connection_closed(master):
    sock = raw(master)
    sock.sendall(pack_header(99, 3, 0))
    status, request_id, _ = read_reply(sock)
    assert (status, request_id) == (Status.BAD_FRAME, 3) and closed(sock)


def test_a_body_that_does_not_parse_is_invalid_and_the_connection_goes_on(master):
    sock = raw(master)
    junk = b"\xff\xff\xff\xff\x0f"
    sock.sendall(pack_header(Method.SCHEDULE, 1, len(junk)) + junk)
    status, request_id, body = read_reply(sock)
    assert (status, request_id) == (Status.INVALID, 1) and b"ScheduleRequest" in body
    event = pb.RequestEvent(namespace=NS, request_id="nobody", stage=pb.RequestEvent.CANCELLED).SerializeToString()
    sock.sendall(pack_header(Method.REPORT_REQUEST, 2, len(event)) + event)
    assert read_reply(sock)[:2] == (Status.OK, 2)


def test_a_client_that_dies_mid_frame_leaves_the_master_serving(master):
    for cut in (3, HEADER_SIZE + 2):
        sock = raw(master)
        body = pb.ScheduleRequest(namespace=NS, digests=[b"x" * 32], input_length=32).SerializeToString()
        sock.sendall((pack_header(Method.SCHEDULE, 1, len(body)) + body)[:cut])
        sock.close()
    where = run(with_link(master.conductor_address, lambda link: link.schedule(keys(), 32, 1)))
    assert where.prefill_engine == "P"


def test_connections_past_the_limit_are_told_busy(master):
    port = ConductorPort.open(master.conductor, lambda *_: None, "127.0.0.1", 0, max_connections=1)
    try:
        first = raw(port)
        first.sendall(pack_header(Method.AUTH, 1, 0))
        assert read_reply(first)[0] == Status.OK  # served
        second = raw(port)
        status, _, body = read_reply(second)
        assert status == Status.BUSY and b"1 connections" in body and closed(second)
        with pytest.raises(LinkDown) as err:  # a link turned away: nothing it sent was acted on
            run(with_link(port.address, lambda link: link.schedule(keys(), 32, 1)))
        assert err.value.sent is False
        first.close()
        for _ in range(100):  # the first one's slot is freed once its thread sees it closed
            if port.connections() == 0:
                break
            time.sleep(0.01)
        third = raw(port)
        third.sendall(pack_header(Method.AUTH, 1, 0))
        assert read_reply(third)[0] == Status.OK
    finally:
        port.stop()


# -- security -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    access = access_list(tmp_path_factory.mktemp("access"))
    with MasterServer(access=access) as m:
        with_engines(m, NS_A, token=ADMIN)
        with_engines(m, NS_B, token=ADMIN)
        yield m


def test_under_an_access_file_a_call_without_auth_is_refused_and_closed(guarded):
    sock = raw(guarded)
    body = pb.ScheduleRequest(namespace=NS_A, digests=[b"x" * 32], input_length=32).SerializeToString()
    sock.sendall(pack_header(Method.SCHEDULE, 1, len(body)) + body)
    assert read_reply(sock)[0] == Status.UNAUTHENTICATED and closed(sock)
    sock = raw(guarded)  # a header announcing the largest body, and no body: refused from the header
    sock.sendall(pack_header(Method.SCHEDULE, 2, MAX_BODY_BYTES))
    assert read_reply(sock)[:2] == (Status.UNAUTHENTICATED, 2) and closed(sock)


@pytest.mark.parametrize("token", [WRONG, "", "x" * 100])
def test_a_wrong_token_is_unauthenticated(guarded, token):
    with pytest.raises(Unauthenticated):
        run(with_link(guarded.conductor_address, lambda link: link.schedule(keys(1, NS_A), 32, 1), token=token))


def test_a_token_is_held_to_its_role_and_namespaces(guarded):
    async def schedule(link, namespace):
        return await link.schedule(keys(1, namespace), 32, 1)

    where = run(with_link(guarded.conductor_address, lambda link: schedule(link, NS_A), token=TENANT_A))
    assert where.prefill_engine == "P"
    with pytest.raises(PermissionDenied, match="globex"):  # another tenant's namespace
        run(with_link(guarded.conductor_address, lambda link: schedule(link, NS_B), token=TENANT_A))
    with pytest.raises(PermissionDenied, match="may not call"):  # a node's token schedules nothing
        run(with_link(guarded.conductor_address, lambda link: schedule(link, NS_A), token=NODE))


def test_an_oversized_token_is_a_bad_frame(guarded):
    sock = raw(guarded)
    sock.sendall(pack_header(Method.AUTH, 1, 5000) + b"t" * 5000)
    assert read_reply(sock)[0] == Status.BAD_FRAME and closed(sock)


def test_over_tls_with_the_masters_certificate(tmp_path):
    pytest.importorskip("cryptography")
    from bench.pki import issue, make_ca
    from kvstore.security.tls import ServerTLS
    from kvstore_client.credentials import Credentials

    ca = make_ca(tmp_path)
    tls = ServerTLS(*issue(tmp_path, ca, "server", server=True), ca=str(ca[2]))
    with MasterServer(tls=tls) as m:
        with_engines(m, tls_ca=str(ca[2]))
        context = Credentials(tls_ca=str(ca[2])).client_tls()
        where = run(with_link(m.conductor_address, lambda link: link.schedule(keys(), 32, 1), tls=context))
        assert where.decode_engine == "D"
        sock = raw(m)  # plain TCP to a TLS port: the handshake fails, the master goes on
        sock.sendall(pack_header(Method.AUTH, 1, 0))
        assert closed(sock)
        with pytest.raises(LinkDown):  # a CA that did not sign the master's certificate
            other = make_ca(tmp_path, "another CA")
            strange = ssl.create_default_context(cafile=str(other[2]))
            run(with_link(m.conductor_address, lambda link: link.schedule(keys(), 32, 1), tls=strange))


# -- the router's choice --------------------------------------------------------------------
class PortOf(PoolBackend):
    """A PoolBackend whose conductor port is ``port`` (one the test stops)."""

    def __init__(self, client, port):
        super().__init__(client)
        self.port = port

    def conductor_port(self):
        return (self.port.address, None, None)


def test_the_router_uses_the_port_and_falls_back_to_grpc_when_it_goes(master):
    port = ConductorPort.open(master.conductor, lambda *_: None, "127.0.0.1", 0)

    async def scenario(backend):
        calls = ConductorCalls(backend)
        first = await calls.schedule(keys(), 32, 1, "a", NS)
        on_port = calls.link_address
        port.stop()  # the port goes away: the next call cannot be sent there, and goes over gRPC
        await asyncio.sleep(0.05)
        second = await calls.schedule(keys(), 32, 1, "b", NS)
        after = calls.link_address
        await calls.report(NS, "a", "cancelled")
        await calls.report(NS, "b", "cancelled")
        await calls.close()
        return first, on_port, second, after

    with Client(master.address) as client:
        first, on_port, second, after = run(scenario(PortOf(client, port)))
    assert on_port == port.address
    assert first.prefill_engine == second.prefill_engine == "P"
    assert after is None  # gRPC for now; the port is asked again a second later
    assert master.conductor.conductor(NS).in_flight() == 0  # both requests reached the conductor once


def test_the_router_uses_grpc_when_the_master_has_no_port():
    with MasterServer(conductor_port=None) as m, Client(m.address) as client:
        with_engines(m)

        async def scenario():
            calls = ConductorCalls(PoolBackend(client))
            where = await calls.schedule(keys(), 32, 1, "g", NS)
            return where, calls.link_address

        where, address = run(scenario())
        assert where.prefill_engine == "P" and address is None


def test_a_link_to_nothing_is_down_and_unsent():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"  # bound, never listening: refused
        with pytest.raises(LinkDown) as err:
            run(with_link(address, lambda link: link.schedule(keys(), 32, 1)))
    assert err.value.sent is False


def test_a_reply_that_is_not_a_frame_is_a_protocol_error_for_the_client():
    with pytest.raises(ProtocolError):
        unpack_header(b"HTTP/1.1 400")


def test_a_token_revoked_by_a_reload_is_refused_on_its_open_connection(tmp_path):
    from tests.access_files import ACCESS_TOML, write_access_file

    path = write_access_file(tmp_path / "access")
    access = AccessList.load(str(path))
    with MasterServer(access=access) as m:
        with_engines(m, NS_B, token=ADMIN)

        async def schedule_twice(link):
            first = await link.schedule(keys(1, NS_B), 32, 1)
            path.write_text(ACCESS_TOML[: ACCESS_TOML.index("[tokens.globex]")])  # tenant B leaves the file
            assert access.reload()
            await link.schedule(keys(1, NS_B), 32, 1)  # the same connection, its next frame
            return first

        with pytest.raises(Unauthenticated, match="revoked"):
            run(with_link(m.conductor_address, schedule_twice, token=TENANT_B))
