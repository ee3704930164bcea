"""Masters that survive failure, on a real etcd: two masters, a node and a verifying client.

Skipped when no ``etcd`` binary is on PATH (scripts/test installs Debian's
etcd-server when it runs as root). Lease TTLs of 2 s keep the file short.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from bench.etcd_process import etcd_binary
from bench.failover import first_put, indexed, leader_of, one_run, run_cluster, wait_until, write_blocks, wrong_bytes
from kvstore.master.election import LEADER_METADATA
from kvstore_client import Client
from kvstore_client.cluster_address import parse_etcd_address
from kvstore_client.proto import kvstore_pb2 as pb
from kvstore_client.proto import kvstore_pb2_grpc as pb_grpc

needs_etcd = pytest.mark.skipif(
    etcd_binary() is None, reason="no etcd binary on PATH (apt-get install etcd-server; scripts/test does it as root)"
)


def test_etcd_addresses_parse():
    assert parse_etcd_address("etcd://a:1,b:2") == (["a:1", "b:2"], "/kvstore")
    assert parse_etcd_address("etcd://a:1/team/") == (["a:1"], "/team")
    with pytest.raises(ValueError):
        parse_etcd_address("etcd://nohostport")


@needs_etcd
def test_leader_kill_standby_takes_over_with_a_complete_index(tmp_path):
    figures = one_run(tmp_path, lease_ttl=2, count=32)
    print("failover:", figures)
    assert figures["new_leader"]
    assert figures["wrong_bytes"] == 0 and figures["missing_blocks"] == 0
    assert figures["put_s"] < 10 and figures["index_s"] < 12


def _register(address: str) -> grpc.RpcError | None:
    """A mutating RPC sent straight to one master; the error it got (None: it was served)."""
    with grpc.insecure_channel(address) as channel:
        try:
            pb_grpc.MasterStub(channel).Register(
                pb.RegisterRequest(info=pb.NodeInfo(node_id="intruder", data_address="127.0.0.1:1")), timeout=5
            )
        except grpc.RpcError as exc:
            return exc
    return None


@needs_etcd
def test_paused_leader_does_not_serve_when_resumed(tmp_path):
    with run_cluster(tmp_path, lease_ttl=2) as (etcd, (first, second), node, address):
        assert _register(second.record["master"]).code() == grpc.StatusCode.UNAVAILABLE  # a standby refuses
        first.signal(signal.SIGSTOP)
        try:
            wait_until(lambda: leader_of(etcd.endpoint) == second.record["master"], 15)
        finally:
            first.signal(signal.SIGCONT)
        refused = _register(first.record["master"])  # at once: before its election thread has caught up
        assert refused is not None and refused.code() == grpc.StatusCode.UNAVAILABLE, refused
        time.sleep(0.5)  # and later, once it has read etcd: it names the new leader
        refused = _register(first.record["master"])
        assert refused.code() == grpc.StatusCode.UNAVAILABLE
        assert dict(refused.trailing_metadata()).get(LEADER_METADATA) == second.record["master"]
        with Client(address, timeout=10) as client:  # the cluster itself serves, through the new leader
            blocks = write_blocks(client, 4, b"new")
            assert wrong_bytes(client, blocks) == (0, 0)


@needs_etcd
def test_a_put_during_failover_waits_for_the_nodes_to_register_again(tmp_path):
    with run_cluster(tmp_path, lease_ttl=2, node_ttl=5.0) as (etcd, (first, second), node, address):
        with Client(address, timeout=10) as client:
            node.signal(signal.SIGSTOP)  # it cannot re-register until the put below is waiting
            try:
                first.signal(signal.SIGKILL)
                wait_until(lambda: leader_of(etcd.endpoint) == second.record["master"], 15)
                writer = ThreadPoolExecutor(1).submit(write_blocks, client, 4, b"failover")
                time.sleep(0.5)
                assert not writer.done()  # the new leader knows no node yet: the put waits, not fails
            finally:
                node.signal(signal.SIGCONT)
            blocks = writer.result(timeout=15)
            assert wrong_bytes(client, blocks) == (0, 0)


@needs_etcd
def test_masters_recover_when_etcd_restarts(tmp_path):
    with run_cluster(tmp_path, lease_ttl=2) as (etcd, masters, node, address):
        with Client(address, timeout=10) as client, Client(address, timeout=10) as checker:
            blocks = write_blocks(client, 8, b"before")
            wait_until(lambda: indexed(checker, blocks), 15)
            etcd.stop()
            time.sleep(3)  # past the lease: no master can prove it leads
            for master in masters:
                assert _register(master.record["master"]).code() == grpc.StatusCode.UNAVAILABLE
            etcd.start()
            first_put(client, ("after-restart", b"x" * 16), os.urandom(1024), 30)
            wait_until(lambda: indexed(checker, blocks), 20)
            assert leader_of(etcd.endpoint) in {m.record["master"] for m in masters}
            assert wrong_bytes(checker, blocks) == (0, 0)


@needs_etcd
def test_the_auth_gate_applies_to_standbys_before_the_leader_gate(tmp_path):
    from access_files import ADMIN, access_list
    from bench.etcd_process import EtcdProcess
    from kvstore.master.election import EtcdOptions
    from kvstore.master.server import MasterServer
    from kvstore_client.auth import bearer_metadata

    with EtcdProcess(tmp_path) as etcd:
        options = EtcdOptions(etcd.endpoint, "/auth-test", lease_ttl_s=2)
        leader = MasterServer(access=access_list(tmp_path), etcd=options).start()
        try:
            wait_until(lambda: leader.is_leader, 10)
            standby = MasterServer(access=access_list(tmp_path), etcd=options).start()
            try:
                with grpc.insecure_channel(standby.address) as channel:
                    stub = pb_grpc.MasterStub(channel)
                    with pytest.raises(grpc.RpcError) as anonymous:
                        stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=5)
                    assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED
                    with pytest.raises(grpc.RpcError) as admin:
                        stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=5, metadata=(bearer_metadata(ADMIN),))
                    assert admin.value.code() == grpc.StatusCode.UNAVAILABLE
                leader.stop()  # resigns: the standby takes over within a poll, not a TTL
                wait_until(lambda: standby.is_leader, 2)
            finally:
                standby.stop()
        finally:
            leader.stop()


class FakeMaster:
    """A gRPC server anyone could start and name in etcd: it records the metadata of every call
    (a token sent to it would be stolen) and answers Prove with a made-up proof."""

    def __init__(self):
        from concurrent.futures import ThreadPoolExecutor

        self.metadata: list[tuple] = []
        fake = self

        class Everything(grpc.GenericRpcHandler):
            def service(self, details):
                fake.metadata.append(tuple(details.invocation_metadata))
                if details.method.endswith("/Prove"):
                    return grpc.unary_unary_rpc_method_handler(
                        lambda request, context: pb.ProveReply(proof=b"\0" * 32).SerializeToString()
                    )
                return grpc.unary_unary_rpc_method_handler(lambda request, context: b"")

        self.server = grpc.server(ThreadPoolExecutor(4), handlers=[Everything()])
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def tokens_seen(self) -> list[str]:
        return [value for md in self.metadata for key, value in md if key == "authorization"]

    def stop(self):
        self.server.stop(0)


def write_leader_key(endpoint: str, key: bytes, value: bytes, own_lease: bool) -> None:
    """What any client of etcd with write access can do: put the leader key, on no lease or
    on a lease of its own."""
    from kvstore_client.proto.etcd import rpc_pb2
    from kvstore_client.proto.etcd import rpc_pb2_grpc as rpc_grpc

    with grpc.insecure_channel(endpoint) as channel:
        lease = (
            rpc_grpc.LeaseStub(channel).LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=30), timeout=5).ID if own_lease else 0
        )
        rpc_grpc.KVStub(channel).Put(rpc_pb2.PutRequest(key=key, value=value, lease=lease), timeout=5)


@needs_etcd
@pytest.mark.parametrize("own_lease", [False, True], ids=["no-lease", "forger's-lease"])
def test_a_forged_leader_key_neither_deposes_the_leader_nor_gets_a_token(tmp_path, own_lease):
    from access_files import TENANT_A, access_list
    from bench.etcd_process import EtcdProcess
    from kvstore.master.election import EtcdOptions
    from kvstore.master.server import MasterServer
    from kvstore_client.errors import ServiceUnavailable

    fake = FakeMaster()
    try:
        with EtcdProcess(tmp_path) as etcd:
            options = EtcdOptions(etcd.endpoint, "/pool", lease_ttl_s=2)
            leader = MasterServer(access=access_list(tmp_path), etcd=options).start()
            try:
                wait_until(lambda: leader.is_leader, 10)
                address = f"etcd://{etcd.endpoint}/pool"
                with Client(address, token=TENANT_A) as client:
                    assert client.cluster_status().nodes is not None
                    for _ in range(3):
                        write_leader_key(etcd.endpoint, b"/pool/leader", fake.address.encode(), own_lease)
                        wait_until(lambda: leader_of(etcd.endpoint, "/pool") == leader.address, 5)
                        assert leader.is_leader
                        client.cluster_status()  # the pool goes on serving through it
                # No master at all under another prefix: the forged key is all a client finds.
                write_leader_key(etcd.endpoint, b"/empty/leader", fake.address.encode(), own_lease)
                with Client(f"etcd://{etcd.endpoint}/empty", token=TENANT_A, timeout=2) as client:
                    with pytest.raises(ServiceUnavailable, match="no master wrote it|could not prove"):
                        client.cluster_status()
                assert fake.tokens_seen() == []  # not one call carried a token
            finally:
                leader.stop()
    finally:
        fake.stop()
