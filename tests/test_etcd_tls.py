"""TLS to etcd, on a real etcd that speaks only TLS and wants client certificates.

A throwaway CA (tests/test_tls.py's helpers) signs etcd's certificate and a
client certificate; another CA signs a stranger's. etcd starts with
--cert-file/--key-file/--trusted-ca-file/--client-cert-auth on loopback ports
(bench.etcd_process). A master campaigns and leads over TLS, a node and a
client find it through ``etcd://``, the CLI's --etcd-* flags and the
KVSTORE_ETCD_* variables work; a client without the CA, without a
certificate, with a stranger's certificate or in plain text fails at once
with a typed error that says what to fix, and so does a master.

Skipped when no ``etcd`` binary is on PATH.
"""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("cryptography")

from click.testing import CliRunner  # noqa: E402

from bench.etcd_process import EtcdProcess, EtcdServerTLS, etcd_binary  # noqa: E402
from kvstore.cli import main  # noqa: E402
from kvstore.master.election import EtcdOptions  # noqa: E402
from kvstore.master.server import MasterServer  # noqa: E402
from kvstore.node.config import StoreConfig  # noqa: E402
from kvstore.node.daemon import NodeOptions, StorageNode  # noqa: E402
from kvstore_client import Client  # noqa: E402
from kvstore_client.credentials import Credentials  # noqa: E402
from kvstore_client.errors import ConfigError, ServiceUnavailable  # noqa: E402
from kvstore_client.etcd import Etcd, EtcdTLS, EtcdTLSError  # noqa: E402
from tests.processes import wait_for  # noqa: E402
from bench.pki import issue, make_ca  # noqa: E402

needs_etcd = pytest.mark.skipif(etcd_binary() is None, reason="no etcd binary on PATH (apt-get install etcd-server)")
MiB = 1 << 20


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    directory = tmp_path_factory.mktemp("etcd-pki")
    ca, other = make_ca(directory), make_ca(directory, "another CA")
    return {
        "ca": str(ca[2]),
        "other_ca": str(other[2]),
        "server": issue(directory, ca, "etcd", server=True),
        "client": issue(directory, ca, "kvstore", server=False),
        "stranger": issue(directory, other, "stranger", server=False),
    }


@pytest.fixture(scope="module")
def good(pki) -> EtcdTLS:
    return EtcdTLS(pki["ca"], *pki["client"])


@pytest.fixture(scope="module")
def cluster(pki, good, tmp_path_factory):
    """A TLS etcd, a master leading through it and a node that found the master by etcd://."""
    if etcd_binary() is None:
        pytest.skip("no etcd binary on PATH")
    root = tmp_path_factory.mktemp("etcd-tls")
    etcd = EtcdProcess(root, tls=EtcdServerTLS(*pki["server"], trusted_ca=pki["ca"]), client_tls=good)
    master = MasterServer(
        ttl_s=30.0, heartbeat_interval_s=0.2, etcd=EtcdOptions(etcd.endpoint, "/tls", lease_ttl_s=2, tls=good)
    ).start()
    address = f"etcd://{etcd.endpoint}/tls"
    node = None
    try:
        wait_for(lambda: master.is_leader, 15)
        node = StorageNode(
            StoreConfig(dram_capacity=8 * MiB, max_block_bytes=MiB),
            NodeOptions(master=address, unix_socket=False, credentials=Credentials(etcd_tls=good)),
        ).start()
        wait_for(lambda: master.membership.live_nodes(), 15)
        yield etcd, master, node, address
    finally:
        if node is not None:
            node.stop()
        master.stop(grace=0)
        etcd.stop(kill=True)


def test_etcd_tls_settings_are_checked(tmp_path, pki):
    assert EtcdTLS.of() is None and EtcdTLS.of(pki["ca"]) == EtcdTLS(pki["ca"])
    with pytest.raises(ConfigError, match="both"):
        EtcdTLS(pki["ca"], pki["client"][0])
    with pytest.raises(ConfigError, match="does not exist"):
        EtcdTLS(str(tmp_path / "missing.pem"))
    env = {"KVSTORE_ETCD_CA": pki["ca"], "KVSTORE_ETCD_CERT": pki["client"][0], "KVSTORE_ETCD_KEY": pki["client"][1]}
    assert EtcdTLS.from_env(env) == EtcdTLS(pki["ca"], *pki["client"]) and EtcdTLS.from_env({}) is None


@needs_etcd
def test_a_master_leads_and_a_node_and_a_client_find_it_over_tls(cluster, good):
    etcd, master, node, address = cluster
    with Client(address, etcd_tls=good, timeout=10) as client:
        client.put(("tls", b"k" * 16), b"over tls")
        assert client.get(("tls", b"k" * 16)) == b"over tls"
        assert [n.info.node_id for n in client.cluster_status().nodes] == [node.info().node_id]
    leader = Etcd([etcd.endpoint], tls=good)
    try:
        assert leader.get(b"/tls/leader").value.decode() == master.address
    finally:
        leader.close()


@needs_etcd
def test_the_etcd_variables_are_read_when_a_client_is_built(cluster, pki, monkeypatch):
    _, master, _, address = cluster
    monkeypatch.setenv("KVSTORE_ETCD_CA", pki["ca"])
    monkeypatch.setenv("KVSTORE_ETCD_CERT", pki["client"][0])
    monkeypatch.setenv("KVSTORE_ETCD_KEY", pki["client"][1])
    with Client(address, timeout=10) as client:
        assert len(client.cluster_status().nodes) == 1


@pytest.mark.parametrize(
    "settings,message",
    [
        (lambda pki: None, "speaks TLS"),  # plain text
        (lambda pki: EtcdTLS(pki["other_ca"], *pki["client"]), "not signed by a CA"),  # wrong CA
        (lambda pki: EtcdTLS(pki["ca"]), "client certificate"),  # no certificate
        (lambda pki: EtcdTLS(pki["ca"], *pki["stranger"]), "client certificate"),  # another CA's certificate
    ],
)
@needs_etcd
def test_a_client_misconfigured_for_etcd_gets_a_clear_typed_error_at_once(cluster, pki, settings, message, monkeypatch):
    for name in ("KVSTORE_ETCD_CA", "KVSTORE_ETCD_CERT", "KVSTORE_ETCD_KEY"):
        monkeypatch.delenv(name, raising=False)
    _, _, _, address = cluster
    start = time.monotonic()
    with Client(address, etcd_tls=settings(pki), timeout=10) as client:
        with pytest.raises(ServiceUnavailable, match=message):
            client.cluster_status()
    assert time.monotonic() - start < 5  # not the call's 10 s timeout: a handshake failure is not retried
    etcd = Etcd([cluster[0].endpoint], tls=settings(pki))
    try:
        with pytest.raises(EtcdTLSError, match=message):
            etcd.get(b"/tls/leader")
    finally:
        etcd.close()


@needs_etcd
def test_a_master_misconfigured_for_etcd_stops_at_start(cluster, pki):
    etcd = cluster[0]
    with pytest.raises(EtcdTLSError, match="speaks TLS"):
        MasterServer(etcd=EtcdOptions(etcd.endpoint, "/tls", lease_ttl_s=2)).start()
    with pytest.raises(EtcdTLSError, match="client certificate"):
        MasterServer(etcd=EtcdOptions(etcd.endpoint, "/tls", lease_ttl_s=2, tls=EtcdTLS(pki["ca"]))).start()
    result = CliRunner().invoke(
        main,
        [
            "master",
            "--port",
            "0",
            "--metrics-port",
            "-1",
            "--etcd",
            etcd.endpoint,
            "--etcd-prefix",
            "/tls",
            "--etcd-ca",
            pki["other_ca"],
        ],
        env={},
    )
    assert result.exit_code == 1 and "EtcdTLSError" in result.output and "--etcd-ca" in result.output, result.output


@needs_etcd
def test_the_cli_reaches_an_etcd_address_with_its_etcd_flags(cluster, pki):
    _, _, node, address = cluster
    runner = CliRunner()
    result = runner.invoke(
        main,
        [
            "status",
            "--master",
            address,
            "--json",
            "--etcd-ca",
            pki["ca"],
            "--etcd-cert",
            pki["client"][0],
            "--etcd-key",
            pki["client"][1],
        ],
        env={},
    )
    assert result.exit_code == 0, result.output
    assert [n["node_id"] for n in json.loads(result.output)["nodes"]] == [node.info().node_id]
    result = runner.invoke(main, ["status", "--master", address], env={})
    assert result.exit_code == 1 and "speaks TLS" in result.output, result.output
