"""Revoking a token without restarts: the access file edited, SIGHUP to the master and the node.

Real master and node processes with an access file; tenant B holds an open data-plane
connection. After B's entry leaves the file and the services get SIGHUP, B's open connection
is closed, new connections and gRPC calls with B's token are refused, all within seconds, and
tenant A is served throughout. A file that no longer loads keeps the tokens in force.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvstore.security.access import AccessList
from kvstore_client import Client
from kvstore_client.credentials import Credentials
from kvstore_client.errors import TransportError, Unauthenticated
from kvstore_client.transport import TcpConnection
from tests.access_files import ACCESS_TOML, NS_A, NS_B, TENANT_A, TENANT_B, write_access_file
from tests.processes import start_master, start_node

KiB = 1 << 10
WITHOUT_B = ACCESS_TOML[: ACCESS_TOML.index("[tokens.globex]")]


def hang_up(*services) -> None:
    for service in services:
        service.proc.send_signal(signal.SIGHUP)


def refused_within(seconds: float, attempt) -> float:
    """Seconds until ``attempt()`` raises a refusal (Unauthenticated, or the connection closed)."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        try:
            attempt()
        except (Unauthenticated, TransportError) as exc:
            print("refused:", type(exc).__name__, exc)
            return time.monotonic() - start
        time.sleep(0.05)
    pytest.fail(f"still served {seconds} s after the reload")


def test_a_token_removed_from_the_file_is_refused_everywhere_within_seconds(tmp_path):
    access_file = write_access_file(tmp_path / "access")
    master = start_master(ttl=30.0, extra=("--auth", str(access_file)))
    node = start_node(master.record["master"], tmp_path / "node", ssd="0", extra=("--auth", str(access_file)))
    try:
        data = node.record["data"]
        a = TcpConnection(data, credentials=Credentials(TENANT_A))
        b = TcpConnection(data, credentials=Credentials(TENANT_B))
        a.put((NS_A, b"a" * 16), b"x" * KiB)
        b.put((NS_B, b"b" * 16), b"y" * KiB)
        with Client(master.record["master"], token=TENANT_B) as client:
            client.cluster_status()

        assert b.get((NS_B, b"b" * 16)) == b"y" * KiB
        access_file.write_text(WITHOUT_B)
        hang_up(master, node)
        took = refused_within(5.0, lambda: b.get((NS_B, b"b" * 16)))
        print(f"open connection refused {took:.2f} s after SIGHUP")
        with pytest.raises(Unauthenticated):
            TcpConnection(data, credentials=Credentials(TENANT_B)).ping()
        with Client(master.record["master"], token=TENANT_B) as client:
            with pytest.raises(Unauthenticated):
                client.cluster_status()
        assert a.get((NS_A, b"a" * 16)) == b"x" * KiB  # the tenant still in the file: served throughout
        a.close()
        b.close()
    finally:
        node.close()
        master.close()


def test_a_file_that_no_longer_loads_keeps_the_tokens_in_force(tmp_path):
    path = write_access_file(tmp_path / "access")
    access = AccessList.load(str(path))
    changes = []
    access.subscribe(lambda: changes.append(access.generation))
    path.write_text("[tokens.broken]\nrole = 'admin'\n")  # no secret: does not load
    assert not access.reload() and access.bearer(TENANT_B) is not None and changes == []
    os.chmod(path, 0o644)
    path.write_text(WITHOUT_B)
    assert not access.reload() and access.bearer(TENANT_B) is not None  # readable by others: refused
    os.chmod(path, 0o600)
    assert access.reload() and access.bearer(TENANT_B) is None and access.bearer(TENANT_A) is not None
    assert changes == [1]
    assert not access.reload()  # nothing changed: no new generation
    assert changes == [1]


def test_the_access_list_says_which_connections_may_go_on(tmp_path):
    path = write_access_file(tmp_path / "access")
    access = AccessList.load(str(path))
    from kvstore_client.auth import DataKey

    key_a, key_b = DataKey.of_token(TENANT_A), DataKey.of_token(TENANT_B)
    (_, a), (_, b) = access.data_key(key_a.key_id), access.data_key(key_b.key_id)
    path.write_text(ACCESS_TOML.replace('namespaces = ["acme", "acme-*"]', 'namespaces = ["acme"]') + "\n")
    assert access.reload()
    assert access.still_valid(key_b, b)  # unchanged
    assert not access.still_valid(key_a, a)  # its namespaces changed: it must authenticate again
    path.write_text(WITHOUT_B)
    assert access.reload() and not access.still_valid(key_b, b)
