"""Two tenants on one pool, end to end: a master and two storage node processes with one access
file, both data paths (TCP, and same-host shared memory with its Unix control socket).

Tenant A puts; tenant B can neither read, overwrite, remove, list, test nor prefix-match A's
blocks (each refused with PermissionDenied), through the SDK's Client and straight at each node's
data plane; A then still reads exactly its bytes, and the admin sees everything.
"""

from __future__ import annotations

import pytest

from kvstore_client import BlockHasher, Client
from kvstore_client.credentials import Credentials
from kvstore_client.errors import PermissionDenied
from kvstore_client.shm import ShmConnection
from kvstore_client.transport import TcpConnection, UnixConnection
from tests.access_files import ADMIN, NODE, NS_A, NS_B, TENANT_A, TENANT_B, write_access_file
from tests.conftest import value_for
from tests.processes import Service, start_master, wait_for

KiB = 1 << 10
PATHS = ["tcp", "shm"]


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    base = tmp_path_factory.mktemp("isolation")
    access = str(write_access_file(base))
    master = start_master(ttl=30.0, extra=("--auth", access))
    nodes = []
    try:
        for i in range(2):
            nodes.append(
                Service(
                    [
                        "node",
                        "--master",
                        master.record["master"],
                        "--port",
                        "0",
                        "--metrics-port",
                        "-1",
                        "--data-dir",
                        str(base / f"n{i}"),
                        "--dram",
                        "32MiB",
                        "--ssd",
                        "0",
                        "--max-block",
                        "1MiB",
                        "--auth",
                        access,
                        "--token",
                        NODE,
                    ]
                )
            )
        with Client(master.record["master"], token=ADMIN) as admin:
            wait_for(lambda: sum(n.alive for n in admin.cluster_status().nodes) == 2, timeout=30)
        yield master.record["master"], nodes
    finally:
        for node in nodes:
            node.close()
        master.close()


@pytest.fixture(scope="module", params=PATHS)
def stored(pool, request):
    """Tenant A's blocks, put over one data path; (path, keys, values)."""
    master, _ = pool
    path = request.param
    keys = BlockHasher(NS_A if path == "tcp" else f"{NS_A}-{path}", 4).keys(list(range(4 * 24)))  # both A's
    values = [value_for(k, 8 * KiB) for k in keys]
    with Client(
        master, token=TENANT_A, data_path=path, location_ttl=0, placement_ttl=0, placement_bytes=64 * KiB
    ) as a:  # a placement per 8 blocks: they spread over the nodes
        for i in range(0, len(keys), 8):
            a.batch_put(keys[i : i + 8], values[i : i + 8])
        wait_for(lambda: all(a.batch_exists(keys)), timeout=30)
    return path, keys, values


def holders(master: str, keys) -> set[str]:
    with Client(master, token=ADMIN) as admin:
        entries = admin.list_keys(namespace=keys[0][0], limit=10_000).keys
    wanted = set(keys)
    return {r.node_id for e in entries if (e.namespace, e.digest) in wanted for r in e.replicas}


def test_a_tenants_blocks_span_both_nodes(pool, stored):
    """The claims below are about both nodes, not one."""
    _, keys, _ = stored
    assert len(holders(pool[0], keys)) == 2


def test_another_tenant_is_refused_everything_through_the_client(pool, stored):
    master, _ = pool
    path, keys, values = stored
    namespace = keys[0][0]
    with Client(master, token=TENANT_B, data_path=path, location_ttl=0) as b:
        refusals = {
            "get": lambda: b.get(keys[0]),
            "batch_get": lambda: b.batch_get(keys[:8]),
            "put": lambda: b.put(keys[0], b"B was here" * 100),
            "batch_put": lambda: b.batch_put(keys[:4], [b"B" * 4096] * 4),
            "remove": lambda: b.remove(keys[1]),
            "exists": lambda: b.exists(keys[2]),
            "batch_exists": lambda: b.batch_exists(keys[:4]),
            "match_prefix": lambda: b.match_prefix(keys[:8]),
            "list_keys": lambda: b.list_keys(namespace=namespace),
        }
        for name, attempt in refusals.items():
            with pytest.raises(PermissionDenied):
                attempt()
                pytest.fail(f"{name} was not refused")
        listed = b.list_keys(limit=10_000)  # every namespace it may see: none of A's
        assert namespace not in listed.namespaces
        assert not {(k.namespace, k.digest) for k in listed.keys} & set(keys)
        assert set(listed.namespaces) <= {NS_B}
        indexed_b = sum(1 for k in listed.keys if k.namespace == NS_B)
        assert b.cluster_status().indexed_keys == indexed_b  # A's blocks are not even counted
    with Client(master, token=TENANT_A, data_path=path, location_ttl=0) as a:
        assert a.batch_get(keys) == values  # exactly A's bytes, nothing overwritten or removed
        assert a.match_prefix(keys).longest == len(keys)


def data_connections(nodes, token: str):
    """One connection of each kind to each node, with ``token``."""
    creds = Credentials(token)
    for node in nodes:
        record = node.record
        yield f"tcp:{record['node_id']}", TcpConnection(record["data"], credentials=creds)
        yield f"unix:{record['node_id']}", UnixConnection(record["unix_socket"], credentials=creds)
        yield f"shm:{record['node_id']}", ShmConnection(record["unix_socket"], record["shm_arena"], credentials=creds)


def test_another_tenant_is_refused_straight_at_every_node(pool, stored):
    """Not asking the master changes nothing: each node checks the namespaces itself, on every
    transport (shared memory included: no one-sided read of another tenant's block)."""
    master, nodes = pool
    _, keys, values = stored
    for name, conn in data_connections(nodes, TENANT_B):
        with conn:
            for attempt in (
                lambda: conn.get(keys[0]),
                lambda: conn.get_many(keys[:4]),
                lambda: conn.put(keys[0], b"overwritten"),
                lambda: conn.remove(keys[0]),
                lambda: conn.exists(keys[0]),
            ):
                with pytest.raises(PermissionDenied):
                    attempt()
                    pytest.fail(f"{name}: not refused")
            own = (NS_B, keys[0][1])  # the same digest in B's own namespace: B's to write
            conn.put(own, b"B's own")
            assert conn.get(own) == b"B's own"
    with Client(master, token=TENANT_A, location_ttl=0) as a:
        assert a.batch_get(keys) == values


def test_the_admin_sees_and_reads_every_tenants_blocks(pool, stored):
    master, nodes = pool
    _, keys, values = stored
    with Client(master, token=ADMIN, location_ttl=0) as admin:
        listed = admin.list_keys(limit=10_000)
        assert keys[0][0] in listed.namespaces
        assert set(keys) <= {(k.namespace, k.digest) for k in listed.keys}
        assert admin.batch_get(keys) == values
        assert admin.cluster_status().indexed_keys >= len(keys)
    for name, conn in data_connections(nodes, ADMIN):
        with conn:
            got = [conn.get(k) for k in keys]
            assert all(v is None or v == values[i] for i, v in enumerate(got)), name
            assert any(v is not None for v in got), name
