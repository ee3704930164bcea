"""TLS for gRPC and the TCP data plane (kvstore.security.tls, kvstore_client.tls).

A throwaway CA signs a server certificate (SAN IP 127.0.0.1 and DNS localhost) and a client
certificate; an in-process master and node serve with them on loopback ports chosen at run
time. A round trip over TLS works; a client without the CA (or with another CA) fails with a
typed error; under mutual TLS a client without a certificate is refused and one with works;
TLS and tokens together.
"""

from __future__ import annotations

import socket
import ssl

import pytest

pytest.importorskip("cryptography")

from bench.pki import issue, make_ca
from kvstore.master.server import MasterServer
from kvstore.node.config import StoreConfig
from kvstore.node.daemon import NodeOptions, StorageNode
from kvstore.security.tls import ServerTLS
from kvstore_client import BlockHasher, Client
from kvstore_client.credentials import Credentials
from kvstore_client.errors import ConfigError, PermissionDenied, ServiceUnavailable, TransportError, Unauthenticated
from kvstore_client.transport import TcpConnection
from tests.access_files import NODE, NS_A, NS_B, TENANT_A, TENANT_B, access_list
from tests.conftest import value_for
from tests.processes import wait_for

KiB, MiB = 1 << 10, 1 << 20
TYPED = (ServiceUnavailable, TransportError)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pki")
    ca = make_ca(directory)
    other = make_ca(directory, "another CA")
    server = issue(directory, ca, "server", server=True)
    client = issue(directory, ca, "client", server=False)
    stranger = issue(directory, other, "stranger", server=False)  # signed by a CA the pool does not trust
    return {"ca": str(ca[2]), "other_ca": str(other[2]), "server": server, "client": client, "stranger": stranger}


def start_pool(pki, *, mutual: bool = False, access=None, node_token: str | None = None):
    tls = ServerTLS(*pki["server"], ca=pki["ca"], mutual=mutual)
    master = MasterServer(ttl_s=30.0, heartbeat_interval_s=0.2, tls=tls, access=access).start()
    node = StorageNode(
        StoreConfig(dram_capacity=8 * MiB, max_block_bytes=MiB),
        NodeOptions(
            master=master.address, unix_socket=False, tls=tls, access=access, credentials=tls.dialing(node_token)
        ),
    ).start()
    return master, node


def stop_pool(master, node) -> None:
    node.stop()
    master.stop(grace=0)


@pytest.fixture(scope="module")
def tls_pool(pki):
    master, node = start_pool(pki)
    yield master, node
    stop_pool(master, node)


@pytest.fixture(scope="module")
def mutual_pool(pki):
    master, node = start_pool(pki, mutual=True)
    yield master, node
    stop_pool(master, node)


@pytest.fixture(scope="module")
def secure_pool(pki, tmp_path_factory):
    """TLS and an access file together."""
    master, node = start_pool(pki, access=access_list(tmp_path_factory.mktemp("access")), node_token=NODE)
    yield master, node
    stop_pool(master, node)


def round_trip(master: str, namespace: str = "tls", **credentials) -> None:
    keys = BlockHasher(namespace, 4).keys(list(range(4 * 8)))
    values = [value_for(k, 16 * KiB) for k in keys]
    with Client(master, data_path="tcp", location_ttl=0, timeout=10, **credentials) as client:
        client.batch_put(keys, values)
        wait_for(lambda: all(client.batch_exists(keys)), timeout=30)
        assert client.batch_get(keys) == values
        assert client.cluster_status().nodes  # a gRPC read too


def test_the_node_registers_over_tls(tls_pool, pki):
    master, node = tls_pool
    with Client(master.address, tls_ca=pki["ca"]) as client:
        wait_for(lambda: any(n.info.node_id == node.node_id and n.alive for n in client.cluster_status().nodes))


def test_a_round_trip_over_tls(tls_pool, pki):
    round_trip(tls_pool[0].address, tls_ca=pki["ca"])


def test_the_tcp_data_plane_speaks_tls_only(tls_pool, pki):
    node = tls_pool[1]
    address = node.server.address
    with TcpConnection(address, credentials=Credentials(tls_ca=pki["ca"])) as conn:
        conn.put(("tls", b"d" * 16), b"over tls")
        assert conn.get(("tls", b"d" * 16)) == b"over tls"
    with pytest.raises(TransportError):  # plain frames to a TLS port: no answer but a closed connection
        TcpConnection(address, timeout=10)
    with pytest.raises(TransportError, match="TLS"):  # a node whose certificate this CA did not sign
        TcpConnection(address, credentials=Credentials(tls_ca=pki["other_ca"]), timeout=10)


def test_a_client_without_the_ca_fails_typed(tls_pool, pki):
    master = tls_pool[0].address
    keys = BlockHasher("tls", 4).keys(list(range(4)))
    with Client(master, timeout=3) as plain:  # no TLS at all against a TLS master
        with pytest.raises(TYPED):
            plain.get(keys[0])
    with Client(master, tls_ca=pki["other_ca"], timeout=3) as wrong:  # TLS, but it cannot verify the master
        with pytest.raises(TYPED):
            wrong.batch_put(keys[:1], [b"x"])


def test_the_server_certificate_is_checked_by_name(tls_pool, pki):
    """The data plane verifies the certificate for the host it dials: 127.0.0.1 is in the SAN."""
    port = int(tls_pool[1].server.address.rsplit(":", 1)[1])
    context = Credentials(tls_ca=pki["ca"]).client_tls()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with pytest.raises(ssl.SSLCertVerificationError):
            context.wrap_socket(raw, server_hostname="not-this-host.example")


def test_mutual_tls_refuses_a_client_without_a_certificate(mutual_pool, pki):
    master, node = mutual_pool
    with Client(master.address, tls_ca=pki["ca"], timeout=3) as anonymous:
        with pytest.raises(TYPED):
            anonymous.cluster_status()
    with pytest.raises(TransportError):
        with TcpConnection(node.server.address, credentials=Credentials(tls_ca=pki["ca"]), timeout=10) as conn:
            conn.get(("tls", b"d" * 16))
    cert, key = pki["stranger"]  # a certificate, but from another CA
    with pytest.raises(TransportError):
        with TcpConnection(
            node.server.address, timeout=10, credentials=Credentials(tls_ca=pki["ca"], tls_cert=cert, tls_key=key)
        ) as conn:
            conn.get(("tls", b"d" * 16))


def test_mutual_tls_serves_a_client_with_a_certificate(mutual_pool, pki):
    master, node = mutual_pool
    cert, key = pki["client"]
    wait_for(lambda: _registered(master, node, pki))
    round_trip(master.address, namespace="mtls", tls_ca=pki["ca"], tls_cert=cert, tls_key=key)


def _registered(master, node, pki) -> bool:
    cert, key = pki["client"]
    with Client(master.address, tls_ca=pki["ca"], tls_cert=cert, tls_key=key) as client:
        return any(n.info.node_id == node.node_id and n.alive for n in client.cluster_status().nodes)


def test_tls_and_tokens_together(secure_pool, pki):
    master = secure_pool[0].address
    round_trip(master, namespace=NS_A, tls_ca=pki["ca"], token=TENANT_A)
    keys = BlockHasher(NS_A, 4).keys(list(range(4 * 8)))
    with Client(master, tls_ca=pki["ca"], token=TENANT_B, data_path="tcp") as b:
        with pytest.raises(PermissionDenied):
            b.get(keys[0])
        round_trip(master, namespace=NS_B, tls_ca=pki["ca"], token=TENANT_B)
    with Client(master, tls_ca=pki["ca"], data_path="tcp") as nobody:  # TLS but no token
        with pytest.raises(Unauthenticated):
            nobody.get(keys[0])
    with Client(master, token=TENANT_A, timeout=3) as no_tls:  # a token but no TLS
        with pytest.raises(TYPED):
            no_tls.get(keys[0])
    with pytest.raises(Unauthenticated):  # straight at the node: TLS handshake, then AUTH
        TcpConnection(secure_pool[1].server.address, credentials=Credentials(tls_ca=pki["ca"]))


def test_tls_settings_are_checked_up_front(pki, tmp_path):
    cert, key = pki["server"]
    with pytest.raises(ConfigError, match="mutual"):
        ServerTLS(cert, key, mutual=True)
    with pytest.raises(ConfigError, match="does not exist"):
        ServerTLS(cert, str(tmp_path / "missing.key"))
    with pytest.raises(ConfigError):
        ServerTLS(cert, pki["client"][1])  # a key that is not the certificate's
    with pytest.raises(ConfigError):
        Credentials(tls_cert=cert, tls_key=key)  # a client certificate without the CA
