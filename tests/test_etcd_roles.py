"""The etcd roles of deploy/etcd-roles.sh on a real etcd with auth on and client certificates.

etcd speaks TLS only and maps each client certificate's CN to an etcd user. After the script:
a master (CN=master1) campaigns and leads, a node (CN=node1) claims its id and registers, an
engine (CN=engine) finds the master and stores and reads blocks; neither the engine nor the
node may write the leader key, and only the master may. Skipped without etcd and etcdctl.
"""

from __future__ import annotations

import shutil
import subprocess

import grpc
import pytest

pytest.importorskip("cryptography")

from bench.etcd_process import EtcdProcess, EtcdServerTLS, etcd_binary  # noqa: E402
from bench.pki import issue, make_ca  # noqa: E402
from kvstore.master.election import EtcdOptions  # noqa: E402
from kvstore.master.server import MasterServer  # noqa: E402
from kvstore.node.config import StoreConfig  # noqa: E402
from kvstore.node.daemon import NodeOptions, StorageNode  # noqa: E402
from kvstore_client import Client  # noqa: E402
from kvstore_client.credentials import Credentials  # noqa: E402
from kvstore_client.etcd import EtcdTLS  # noqa: E402
from kvstore_client.proto.etcd import rpc_pb2  # noqa: E402
from kvstore_client.proto.etcd import rpc_pb2_grpc as rpc_grpc  # noqa: E402
from tests.access_files import NODE, NS_A, TENANT_A, access_list  # noqa: E402
from tests.processes import ROOT, wait_for  # noqa: E402

pytestmark = pytest.mark.skipif(
    etcd_binary() is None or shutil.which("etcdctl") is None,
    reason="needs etcd and etcdctl on PATH (apt-get install etcd-server etcd-client)",
)
MiB = 1 << 20
PREFIX = "/pool"


def write_leader_key(etcd, tls: EtcdTLS) -> grpc.StatusCode:
    """Try to put the leader key as the user of ``tls``: the status etcd answers."""
    credentials = grpc.ssl_channel_credentials(*(open(p, "rb").read() for p in (tls.ca, tls.key, tls.cert)))
    with grpc.secure_channel(etcd.endpoint, credentials) as channel:
        try:
            rpc_grpc.KVStub(channel).Put(rpc_pb2.PutRequest(key=f"{PREFIX}/leader".encode(), value=b"x:1"), timeout=5)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_each_party_does_its_part_and_only_masters_write_the_leader_key(tmp_path):
    ca = make_ca(tmp_path)
    cert = {
        name: EtcdTLS(str(ca[2]), *issue(tmp_path, ca, name, server=False))
        for name in ("root", "master1", "node1", "engine")
    }
    etcd = EtcdProcess(
        tmp_path,
        tls=EtcdServerTLS(*issue(tmp_path, ca, "etcd", server=True), trusted_ca=str(ca[2])),
        client_tls=cert["root"],
    )
    master = node = None
    try:
        root = cert["root"]
        etcdctl = f"etcdctl --endpoints {etcd.url} --cacert {root.ca} --cert {root.cert} --key {root.key}"
        done = subprocess.run(
            [str(ROOT / "deploy" / "etcd-roles.sh"), PREFIX, "master1", "node1", "engine"],
            env={"ETCDCTL": etcdctl, "PATH": "/usr/bin:/bin:/usr/local/bin", "ETCDCTL_API": "3"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        access = access_list(tmp_path / "access")
        master = MasterServer(
            ttl_s=30.0,
            heartbeat_interval_s=0.2,
            access=access,
            etcd=EtcdOptions(etcd.endpoint, PREFIX, lease_ttl_s=2, tls=cert["master1"]),
        ).start()
        wait_for(lambda: master.is_leader, 15)
        address = f"etcd://{etcd.endpoint}{PREFIX}"
        node = StorageNode(
            StoreConfig(dram_capacity=8 * MiB, max_block_bytes=MiB),
            NodeOptions(
                master=address,
                unix_socket=False,
                access=access,
                credentials=Credentials(NODE, etcd_tls=cert["node1"]),
            ),
        ).start()
        wait_for(lambda: master.membership.live_nodes(), 15)
        with Client(address, token=TENANT_A, etcd_tls=cert["engine"], data_path="tcp") as client:
            key = (NS_A, b"k" * 16)
            client.put(key, b"v" * 4096)
            assert client.get(key) == b"v" * 4096
        assert write_leader_key(etcd, cert["engine"]) == grpc.StatusCode.PERMISSION_DENIED
        assert write_leader_key(etcd, cert["node1"]) == grpc.StatusCode.PERMISSION_DENIED
        assert master.is_leader
    finally:
        if node is not None:
            node.stop()
        if master is not None:
            master.stop(grace=0)
        etcd.stop(kill=True)
