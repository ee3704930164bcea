"""The master's gRPC gate (kvstore.security.grpc_gate) against every method of every service.

The methods come from the proto descriptors, so a new RPC is covered (and, until METHOD_ROLES
names it, refused: the table test fails) without touching this file. Each is called through a
generic ``channel.unary_unary`` with a minimal request of its input type: no token and a wrong
one are UNAUTHENTICATED, the wrong role is PERMISSION_DENIED, and where the request names a
namespace, another tenant's is PERMISSION_DENIED. An in-process master and storage node with one
access file, on loopback ports chosen at run time.
"""

from __future__ import annotations

import threading

import grpc
import pytest

from kvstore.master.credentials import node_metadata
from kvstore.master.server import MasterServer
from kvstore.node.config import StoreConfig
from kvstore.node.daemon import NodeOptions, StorageNode
from kvstore.security.access import ADMIN as ADMIN_ROLE, NODE as NODE_ROLE, TENANT as TENANT_ROLE
from kvstore.security.grpc_gate import METHOD_ROLES, OPEN_METHODS
from kvstore_client import BlockHasher, Client
from kvstore_client.auth import bearer_metadata
from kvstore_client.credentials import Credentials
from kvstore_client.errors import PermissionDenied
from kvstore_client.proto import kvstore_pb2 as pb
from kvstore_client.proto import kvstore_pb2_grpc as pb_grpc
from tests.access_files import ADMIN, NODE, NODE2, NS_A, NS_A2, NS_B, TENANT_A, TENANT_B, WRONG, access_list
from tests.conftest import value_for
from tests.processes import wait_for

KiB, MiB = 1 << 10, 1 << 20
Code = grpc.StatusCode
REFUSALS = (Code.UNAUTHENTICATED, Code.PERMISSION_DENIED)


def all_methods():
    """(service descriptor, method descriptor) for every RPC the proto declares."""
    return [(service, method) for service in pb.DESCRIPTOR.services_by_name.values() for method in service.methods]


ALL_METHODS = all_methods()
METHODS = [(s, m) for s, m in ALL_METHODS if f"{s.name}/{m.name}" not in OPEN_METHODS]  # gated ones
IDS = [f"{s.name}/{m.name}" for s, m in METHODS]


def message_class(descriptor):
    try:
        from google.protobuf.message_factory import GetMessageClass
    except ImportError:  # older protobuf
        return getattr(pb, descriptor.name)
    return GetMessageClass(descriptor)


def takes_namespace(method) -> bool:
    return "namespace" in method.input_type.fields_by_name


def minimal_request(method, namespace: str | None = None):
    request = message_class(method.input_type)()
    if namespace is not None:
        request.namespace = namespace
    return request


def call(channel, service, method, request, token: str | None = None, metadata: tuple = ()):
    """One RPC by name; the reply, or the grpc.RpcError it raised."""
    stub = channel.unary_unary(
        f"/{service.full_name}/{method.name}",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=message_class(method.output_type).FromString,
    )
    metadata = tuple(metadata) + ((bearer_metadata(token),) if token is not None else ())
    try:
        return stub(request, timeout=10, metadata=metadata or None)
    except grpc.RpcError as exc:
        return exc


def code_of(outcome) -> Code:
    return outcome.code() if isinstance(outcome, grpc.RpcError) else Code.OK


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """A master with an access file and one node that registered with the node token, holding
    tenant A's blocks (namespace "acme") and tenant B's ("globex")."""
    access = access_list(tmp_path_factory.mktemp("access"))
    master = MasterServer(ttl_s=30.0, heartbeat_interval_s=0.2, access=access).start()
    node = StorageNode(
        StoreConfig(dram_capacity=8 * MiB, max_block_bytes=MiB),
        NodeOptions(master=master.address, unix_socket=False, access=access, credentials=Credentials(NODE)),
    ).start()
    keys_a, keys_b = BlockHasher(NS_A, 4).keys(list(range(16))), BlockHasher(NS_B, 4).keys(list(range(8)))
    for token, keys in ((TENANT_A, keys_a), (TENANT_B, keys_b)):
        with Client(master.address, token=token, data_path="tcp", location_ttl=0) as client:
            client.batch_put(keys, [value_for(k, 4 * KiB) for k in keys])
            wait_for(lambda: all(client.batch_exists(keys)), timeout=30)
    yield master, node, keys_a, keys_b
    node.stop()
    master.stop(grace=0)


@pytest.fixture(scope="module")
def channel(pool):
    with grpc.insecure_channel(pool[0].address) as ch:
        yield ch


ADMIN_ONLY = {"Master/Drain"}  # operator actions: neither nodes nor tenants


def test_every_method_has_roles():
    """A method missing from METHOD_ROLES is refused to everyone: someone must decide who calls it."""
    declared = {f"{s.name}/{m.name}" for s, m in ALL_METHODS}
    assert not OPEN_METHODS & set(METHOD_ROLES), "a method is either open or gated"
    assert OPEN_METHODS <= declared, "OPEN_METHODS names methods the proto does not declare"
    declared -= OPEN_METHODS
    assert declared - set(METHOD_ROLES) == set(), "methods with no roles in METHOD_ROLES"
    assert set(METHOD_ROLES) - declared == set(), "METHOD_ROLES names methods the proto does not declare"
    for service, method in ALL_METHODS:  # AuthGate passes streaming handlers through ungated
        assert not method.client_streaming and not method.server_streaming, (
            f"{service.name}/{method.name} streams: teach AuthGate to gate it first"
        )
    for name, roles in METHOD_ROLES.items():
        assert ADMIN_ROLE in roles, name
        assert not {NODE_ROLE, TENANT_ROLE} <= roles, f"{name}: nodes or tenants, not both"
        assert roles != {ADMIN_ROLE} or name in ADMIN_ONLY, f"{name}: admin only, but not said so in ADMIN_ONLY"


@pytest.mark.parametrize("service,method", METHODS, ids=IDS)
def test_no_token_and_a_wrong_token_are_unauthenticated(channel, service, method):
    for token, metadata in (
        (None, ()),
        (WRONG, ()),
        ("", ()),
        (None, (("authorization", f"Basic {ADMIN}"),)),
        (None, (("authorization", ADMIN),)),
    ):
        outcome = call(
            channel,
            service,
            method,
            minimal_request(method, NS_A if takes_namespace(method) else None),
            token,
            metadata,
        )
        assert code_of(outcome) == Code.UNAUTHENTICATED, (token, metadata, outcome)


@pytest.mark.parametrize("service,method", METHODS, ids=IDS)
def test_a_token_of_the_wrong_role_is_permission_denied(channel, service, method):
    roles = METHOD_ROLES[f"{service.name}/{method.name}"]
    request = minimal_request(method, NS_A if takes_namespace(method) else None)
    for token, role in ((NODE, NODE_ROLE), (TENANT_A, TENANT_ROLE), (ADMIN, ADMIN_ROLE)):
        outcome = call(channel, service, method, request, token)
        if role in roles:  # let in: whatever the method makes of a minimal request, not a refusal
            assert code_of(outcome) not in REFUSALS, (role, outcome)
        else:
            assert code_of(outcome) == Code.PERMISSION_DENIED, (role, outcome)
            assert role in outcome.details()


NAMESPACED = [(s, m) for s, m in METHODS if takes_namespace(m)]


@pytest.mark.parametrize("service,method", NAMESPACED, ids=[f"{s.name}/{m.name}" for s, m in NAMESPACED])
def test_another_tenants_namespace_is_permission_denied(channel, service, method):
    roles = METHOD_ROLES[f"{service.name}/{method.name}"]
    if TENANT_ROLE not in roles:
        pytest.skip("tenants may not call it at all (the role test covers it)")
    for token, theirs in ((TENANT_A, NS_B), (TENANT_B, NS_A), (TENANT_B, NS_A2), (TENANT_A, "acmex")):
        outcome = call(channel, service, method, minimal_request(method, theirs), token)
        assert code_of(outcome) == Code.PERMISSION_DENIED, (token, theirs, outcome)
        assert theirs in outcome.details()
    for token, own in ((TENANT_A, NS_A), (TENANT_A, NS_A2), (TENANT_B, NS_B), (ADMIN, NS_B)):
        outcome = call(channel, service, method, minimal_request(method, own), token)
        assert code_of(outcome) not in REFUSALS, (token, own, outcome)


def test_a_method_not_in_the_table_is_refused_to_everyone(pool, monkeypatch):
    """Take one method out of METHOD_ROLES: even the admin is refused, the servicer never runs."""
    monkeypatch.delitem(METHOD_ROLES, "Master/ClusterStatus")
    with Client(pool[0].address, token=ADMIN) as client:
        with pytest.raises(PermissionDenied, match="ClusterStatus"):
            client.cluster_status()


def test_listing_without_a_namespace_shows_a_tenant_only_its_own(pool):
    master, node, keys_a, keys_b = pool
    with Client(master.address, token=ADMIN) as admin:  # tier figures come with heartbeats
        wait_for(lambda: sum(t.blocks for n in admin.cluster_status().nodes for t in n.tiers) > 0)
    with Client(master.address, token=TENANT_A) as client:
        reply = client.list_keys(limit=1000)
        assert set(reply.namespaces) == {NS_A}
        assert {(k.namespace, k.digest) for k in reply.keys} == set(keys_a)
        status = client.cluster_status()
        assert status.indexed_keys == len(keys_a)
        assert all(n.indexed_blocks == 0 for n in status.nodes)  # per node: the pool's, not shown to a tenant
        tiers = [t for n in status.nodes for t in n.tiers]
        assert tiers and all(t.capacity > 0 for t in tiers)  # sizes, and nothing of what others hold or hit
        assert all((t.used, t.blocks, t.hits, t.misses, t.evictions) == (0, 0, 0, 0, 0) for t in tiers)
        with pytest.raises(PermissionDenied):
            client.list_keys(namespace=NS_B)
    with Client(master.address, token=TENANT_B) as client:
        reply = client.list_keys(limit=1000)
        assert set(reply.namespaces) == {NS_B}
        assert {(k.namespace, k.digest) for k in reply.keys} == set(keys_b)
        assert client.cluster_status().indexed_keys == len(keys_b)
    with Client(master.address, token=ADMIN) as client:
        reply = client.list_keys(limit=1000)
        assert set(reply.namespaces) == {NS_A, NS_B}
        assert len(reply.keys) == len(keys_a) + len(keys_b)
        status = client.cluster_status()
        assert status.indexed_keys == len(keys_a) + len(keys_b)
        assert sum(n.indexed_blocks for n in status.nodes) == len(keys_a) + len(keys_b)


def test_a_refused_call_is_answered_from_its_metadata_its_body_never_waited_for(pool):
    """No token, a wrong one, or the wrong role: refused at once from the call's metadata, while
    the caller has not sent (and never sends) its request: no server thread waits for the body."""
    master = pool[0]
    never = threading.Event()

    def body_never_sent():
        never.wait(30)
        yield b""

    with grpc.insecure_channel(master.address) as channel:
        raw = channel.stream_unary("/kvstore.v1.Master/Locate", request_serializer=None, response_deserializer=None)
        try:
            for metadata, code in (
                ((), Code.UNAUTHENTICATED),
                ((bearer_metadata(WRONG),), Code.UNAUTHENTICATED),
                ((bearer_metadata(NODE),), Code.PERMISSION_DENIED),
            ):
                with pytest.raises(grpc.RpcError) as refused:
                    raw(body_never_sent(), timeout=10, metadata=metadata or None)
                assert refused.value.code() == code, (metadata, refused.value)
        finally:
            never.set()


def node_status(channel, node_id: str) -> pb.NodeStatus:
    stub = pb_grpc.MasterStub(channel)
    reply = stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=10, metadata=(bearer_metadata(ADMIN),))
    return next(n for n in reply.nodes if n.info.node_id == node_id)


def test_a_forged_register_is_refused_and_changes_nothing(pool, channel):
    master, node, keys_a, keys_b = pool
    stub = pb_grpc.MasterStub(channel)
    before = node_status(channel, node.node_id)
    assert before.alive and before.indexed_blocks == len(keys_a) + len(keys_b)
    forged = pb.NodeInfo(node_id=node.node_id, data_address="127.0.0.1:9", machine_id="elsewhere")
    real_incarnation = node.agent._metadata  # even the node's own incarnation, under another token
    attempts = [
        (TENANT_A, node_metadata("guess"), Code.PERMISSION_DENIED),
        (TENANT_A, real_incarnation, Code.PERMISSION_DENIED),
        (NODE, node_metadata("another-incarnation"), Code.ALREADY_EXISTS),
        (NODE, (), Code.ALREADY_EXISTS),
        (NODE2, real_incarnation, Code.ALREADY_EXISTS),
        (None, real_incarnation, Code.UNAUTHENTICATED),
    ]
    for token, metadata, code in attempts:
        auth = (bearer_metadata(token),) if token else ()
        calls = [
            lambda: stub.Register(pb.RegisterRequest(info=forged), timeout=10, metadata=auth + tuple(metadata)),
            lambda: stub.ReportBlocks(
                pb.BlockReport(node_id=node.node_id, full_inventory=True), timeout=10, metadata=auth + tuple(metadata)
            ),
            lambda: stub.Heartbeat(
                pb.HeartbeatRequest(node_id=node.node_id), timeout=10, metadata=auth + tuple(metadata)
            ),
        ]
        for attempt in calls:
            with pytest.raises(grpc.RpcError) as err:
                attempt()
            assert err.value.code() == code, (token, metadata, err.value)
    after = node_status(channel, node.node_id)
    assert after.info == before.info and after.alive
    assert after.indexed_blocks == len(keys_a) + len(keys_b)
    with Client(master.address, token=TENANT_A, data_path="tcp", location_ttl=0) as client:
        assert client.batch_get(keys_a) == [value_for(k, 4 * KiB) for k in keys_a]


def test_prove_is_open_and_proves_only_the_callers_own_key(pool):
    """Master/Prove answers without a token; the proof is an HMAC under the token's key of the
    nonce and the master's address, checkable by that token's holder only; an unknown key id
    is UNAUTHENTICATED."""
    import secrets

    from kvstore_client.auth import DataKey
    from kvstore_client.leader_record import master_proof

    master = pool[0]
    with grpc.insecure_channel(master.address) as channel:
        stub = pb_grpc.MasterStub(channel)
        nonce = secrets.token_bytes(32)
        for token in (TENANT_A, NODE):
            key = DataKey.of_token(token)
            reply = stub.Prove(pb.ProveRequest(key_id=key.key_id, nonce=nonce), timeout=10)
            assert reply.proof == master_proof(key.key, nonce, master.address)
            assert reply.proof != master_proof(DataKey.of_token(TENANT_B).key, nonce, master.address)
        with pytest.raises(grpc.RpcError) as unknown:
            stub.Prove(pb.ProveRequest(key_id=DataKey.of_token(WRONG).key_id, nonce=nonce), timeout=10)
        assert unknown.value.code() == Code.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as short:
            stub.Prove(pb.ProveRequest(key_id=DataKey.of_token(TENANT_A).key_id, nonce=b"x"), timeout=10)
        assert short.value.code() == Code.INVALID_ARGUMENT
