"""What a caller may leave in the master through the conductor is bounded (security finding 4).

The finding, on a master run with an access file: 400 Schedules with 1 MiB request ids took its
RSS from 46 to 481 MB; engines registered in 3,000 new namespaces took it to 668 MB, kept after
they deregistered; engines were accepted on node ids no node had. Here, against a real master
and node (processes on loopback ports chosen at run time, one access file): oversized fields are
refused with typed errors, a tenant's engines and namespaces stop at its limits, an engine needs
a live node, and the finding's calls replayed leave the master's RSS bounded. In process: the
ledger's counts go back to zero when engines deregister, a tenant's requests in flight stop at
its limit over every namespace, and scheduling and cancelling keeps no expiry entries.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import Future

import grpc
import pytest

from kvstore.master.conductor_service import SchedulingOptions
from kvstore.master.membership import NodeIdentity
from kvstore.master.server import MasterServer
from kvstore.scheduler import Conductor, SimClock
from kvstore.scheduler.ledger import Usage
from kvstore.scheduler.limits import (
    MAX_DIGEST_BYTES,
    MAX_ENGINE_ID_BYTES,
    MAX_REQUEST_ID_BYTES,
    MAX_SCHEDULE_BLOCKS,
    TENANT_LIMITS,
    ConductorLimits,
)
from kvstore_client import Client
from kvstore_client.conductor_link import ConductorLink
from kvstore_client.errors import InvalidValue, Overloaded, QuotaExceeded
from kvstore_client.proto import kvstore_pb2 as pb
from kvstore_client.proto import kvstore_pb2_grpc as pb_grpc
from tests.access_files import ADMIN, NODE, NS_A, NS_A2, NS_B, TENANT_A, TENANT_B, access_list, write_access_file
from tests.processes import Service, start_master, wait_for

MiB = 1 << 20


def keys(namespace: str, n: int = 2):
    return [(namespace, os.urandom(32)) for _ in range(n)]


def rss_mib(pid: int) -> float:
    """The process's resident set (VmRSS), MiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """(master Service, its address, the live node's id): a master and one node, one access file."""
    base = tmp_path_factory.mktemp("bounds")
    access = str(write_access_file(base))
    master = start_master(ttl=30.0, extra=("--auth", access))
    node = None
    try:
        address = master.record["master"]
        node = Service(
            ["node", "--master", address, "--port", "0", "--metrics-port", "-1", "--data-dir", str(base / "n0")]
            + ["--dram", "16MiB", "--ssd", "0", "--max-block", "1MiB", "--auth", access, "--token", NODE]
        )
        with Client(address, token=ADMIN) as admin:
            wait_for(lambda: sum(n.alive for n in admin.cluster_status().nodes) == 1, timeout=30)
        yield master, address, node.record["node_id"]
    finally:
        if node is not None:
            node.close()
        master.close()


class Tenant:
    """Tenant A's conductor calls (``scheduling``), and ``register``, which deregisters at ``close``."""

    def __init__(self, address: str):
        self.client = Client(address, token=TENANT_A)
        self.scheduling = self.client.scheduling
        self._registered: list[tuple[str, str]] = []

    def register(self, namespace: str, engine_id: str, role: str, node_id: str) -> None:
        self.scheduling.register_engine(namespace, engine_id, role, node_id)
        self._registered.append((namespace, engine_id))

    def close(self) -> None:
        for namespace, engine_id in self._registered:
            self.scheduling.deregister_engine(namespace, engine_id)
        self.client.close()


@pytest.fixture
def tenant(pool):
    """Tenant A; every engine it registered through ``register`` is gone after the test (its
    limits hold over the whole module's master)."""
    tenant = Tenant(pool[1])
    yield tenant
    tenant.close()


# -- sizes ----------------------------------------------------------------------------------
def test_an_oversized_request_id_is_refused_with_a_typed_error(pool, tenant):
    master, _, node_id = pool
    tenant.register(NS_A, "P", "prefill", node_id)
    tenant.register(NS_A, "D", "decode", node_id)
    for size in (MAX_REQUEST_ID_BYTES + 1, MiB):
        with pytest.raises(InvalidValue, match=f"request_id is {size} bytes") as refused:
            tenant.scheduling.schedule(keys(NS_A), 64, request_id="r" * size)
        assert len(str(refused.value)) < 200  # the value is never echoed
        with pytest.raises(InvalidValue, match="request_id"):
            tenant.scheduling.report_request(NS_A, "r" * size, "cancelled")
    largest = "r" * MAX_REQUEST_ID_BYTES  # the limit itself is fine
    assert tenant.scheduling.schedule(keys(NS_A), 64, request_id=largest).request_id == largest
    tenant.scheduling.report_request(NS_A, largest, "cancelled")

    async def over_the_port():
        link = ConductorLink(master.record["conductor"], token=TENANT_A)
        try:
            await link.schedule(keys(NS_A), 64, request_id="r" * MiB)
        finally:
            await link.close()

    with pytest.raises(InvalidValue, match="request_id"):  # the conductor port: INVALID
        asyncio.run(over_the_port())


def test_oversized_engine_ids_and_block_digests_are_refused(pool, tenant):
    _, _, node_id = pool
    with pytest.raises(InvalidValue, match="engine_id"):
        tenant.register(NS_A, "e" * (MAX_ENGINE_ID_BYTES + 1), "prefill", node_id)
    with pytest.raises(InvalidValue, match="engine_id"):
        tenant.scheduling.report_load(NS_A, "e" * MiB, queue_length=1)
    with pytest.raises(InvalidValue, match="engine_id"):
        tenant.scheduling.deregister_engine(NS_A, "e" * MiB)
    with pytest.raises(InvalidValue, match="node_id"):
        tenant.register(NS_A, "P", "prefill", "n" * MiB)
    with pytest.raises(InvalidValue, match=f"1..{MAX_DIGEST_BYTES} bytes"):
        tenant.scheduling.schedule([(NS_A, b"d" * (MAX_DIGEST_BYTES + 1))], 64)
    with pytest.raises(InvalidValue, match=f"at most {MAX_SCHEDULE_BLOCKS} blocks"):
        tenant.scheduling.schedule([(NS_A, b"d")] * (MAX_SCHEDULE_BLOCKS + 1), 64)


# -- nodes ----------------------------------------------------------------------------------
def test_an_engine_on_a_node_id_the_pool_does_not_have_is_refused(pool, tenant):
    _, _, node_id = pool
    with pytest.raises(InvalidValue, match="'no-such-node' is not a live storage node"):
        tenant.register(NS_A, "P", "prefill", "no-such-node")
    assert tenant.scheduling.deregister_engine(NS_A, "P").known is False  # nothing was registered
    tenant.register(NS_A, "P", "prefill", node_id)  # the live node's id is fine


# -- per-tenant caps ------------------------------------------------------------------------
def test_a_tenant_cannot_have_engines_in_more_namespaces_than_its_limit(pool, tenant):
    _, _, node_id = pool
    cap = TENANT_LIMITS.namespaces
    for i in range(cap):
        tenant.register(f"{NS_A}-cap-{i}", "P", "prefill", node_id)
    with pytest.raises(QuotaExceeded, match=f"engines in {cap} namespaces"):
        tenant.register(f"{NS_A}-cap-{cap}", "P", "prefill", node_id)
    tenant.register(f"{NS_A}-cap-0", "D", "decode", node_id)  # a namespace it has: fine
    tenant.scheduling.deregister_engine(f"{NS_A}-cap-1", "P")  # its last engine there: one namespace back
    tenant.register(f"{NS_A}-cap-{cap}", "P", "prefill", node_id)
    with Client(pool[1], token=TENANT_B) as other:  # another tenant's limits are its own
        other.scheduling.register_engine(NS_B, "P", "prefill", node_id)
        other.scheduling.deregister_engine(NS_B, "P")


def test_a_tenant_cannot_register_more_engines_than_its_limit(pool, tenant):
    _, _, node_id = pool
    cap = TENANT_LIMITS.engines
    for i in range(cap):
        tenant.register(NS_A2 if i % 2 else NS_A, f"e{i}", "prefill", node_id)
    with pytest.raises(QuotaExceeded, match=f"{cap} engines registered"):
        tenant.register(NS_A, "one-more", "decode", node_id)


# -- memory ---------------------------------------------------------------------------------
def test_the_findings_calls_replayed_leave_the_master_bounded(pool, tenant):
    """Before the fix the master kept these calls' ids: it grew by hundreds of MiB here (the
    finding measured 435 and 622 MB for its own). Now each oversized one is refused and keeps
    nothing, and namespaces registered and deregistered give their memory back."""
    master, _, node_id = pool
    tenant.register(NS_A, "P", "prefill", node_id)
    tenant.register(NS_A, "D", "decode", node_id)
    tenant.scheduling.schedule(keys(NS_A), 64, request_id="warm-up")  # what a first Schedule loads
    tenant.scheduling.report_request(NS_A, "warm-up", "cancelled")
    channel = grpc.insecure_channel(pool[1], options=[("grpc.max_send_message_length", 4 * MiB)])
    stub = pb_grpc.ConductorStub(channel)
    metadata = [("authorization", f"Bearer {TENANT_A}")]
    before = rss_mib(master.proc.pid)
    for i in range(200):  # Schedules with 1 MiB request ids
        request = pb.ScheduleRequest(namespace=NS_A, request_id=f"{i}".ljust(MiB, "r"), input_length=64)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Schedule(request, metadata=metadata, timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for i in range(3000):  # engines in ever new namespaces, with 64 KiB ids, then with the largest allowed
        namespace = f"{NS_A}-ns-{i}"
        engine = pb.EngineRegistration(namespace=namespace, role=pb.PREFILL, node_id=node_id)
        engine.engine_id = f"{i}".ljust(64 << 10, "e")
        with pytest.raises(grpc.RpcError) as refused:
            stub.RegisterEngine(engine, metadata=metadata, timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        engine.engine_id = f"{i}".ljust(MAX_ENGINE_ID_BYTES, "e")
        stub.RegisterEngine(engine, metadata=metadata, timeout=30)
        stub.DeregisterEngine(
            pb.EngineDeregistration(namespace=namespace, engine_id=engine.engine_id), metadata=metadata, timeout=30
        )
    channel.close()
    grown = rss_mib(master.proc.pid) - before
    assert grown < 50, f"the master grew by {grown:.0f} MiB"


def in_process_master(access, **options) -> MasterServer:
    """An in-process master with an access file (its tokens: tests.access_files) and a storage
    node "n1" in its membership (no node process: the conductor only names it)."""
    scheduling = SchedulingOptions(**options)
    master = MasterServer(access=access, scheduling=scheduling, conductor_port=None, ttl_s=600.0)
    master.membership.register(NodeIdentity("n1"))
    return master


def test_deregistering_every_engine_frees_each_namespace_and_its_requests(tmp_path):
    with in_process_master(access_list(tmp_path)) as master, Client(master.address, token=ADMIN) as admin:
        calls, conductors = admin.scheduling, master.conductor
        for i in range(200):
            namespace = f"ns-{i}"
            calls.register_engine(namespace, "P", "prefill", "n1")
            calls.register_engine(namespace, "D", "decode", "n1")
            calls.schedule(keys(namespace), 64, request_id=f"r{i}")
        assert conductors.usage() == Usage(namespaces=200, engines=400, requests=200)
        assert conductors.usage("root") == conductors.usage()  # all the admin token's
        for i in range(200):
            assert calls.deregister_engine(f"ns-{i}", "P").ended_requests == 1  # its queued request
            calls.deregister_engine(f"ns-{i}", "D")
        assert conductors.usage() == Usage()
        assert conductors.conductor("ns-0").engines() == 0


def test_a_tenant_cannot_have_more_requests_in_flight_than_its_limit_over_all_namespaces(tmp_path):
    limits = ConductorLimits(engines=8, namespaces=4, requests=3)
    with in_process_master(access_list(tmp_path), tenant_limits=limits, admission="off") as master:
        with Client(master.address, token=TENANT_A) as a, Client(master.address, token=TENANT_B) as b:
            for client, namespace in ((a, NS_A), (a, NS_A2), (b, NS_B)):
                client.scheduling.register_engine(namespace, f"P-{namespace}", "prefill", "n1")
            a.scheduling.schedule(keys(NS_A), 64, request_id="a1")
            a.scheduling.schedule(keys(NS_A2), 64, request_id="a2")
            a.scheduling.schedule(keys(NS_A2), 64, request_id="a3")
            with pytest.raises(Overloaded) as rejected:
                a.scheduling.schedule(keys(NS_A), 64, request_id="a4")
            assert rejected.value.reason == "too_many_requests" and "'acme' has 3 requests" in str(rejected.value)
            for i in range(3):  # another tenant's requests count on its own
                b.scheduling.schedule(keys(NS_B), 64, request_id=f"b{i}")
            a.scheduling.report_request(NS_A2, "a2", "cancelled")  # one ends: room for one more
            a.scheduling.schedule(keys(NS_A), 64, request_id="a4")
            assert master.conductor.usage("acme").requests == 3
            a.scheduling.deregister_engine(NS_A2, f"P-{NS_A2}")  # its requests end with its engine
            assert master.conductor.usage("acme") == Usage(namespaces=1, engines=1, requests=2)


def test_scheduling_and_cancelling_keeps_no_expiry_entries():
    """Each Schedule pushed an expiry deadline that stayed an hour after its request was
    cancelled: a caller scheduling and cancelling grew the conductor by one entry a call."""
    from kvstore.master.index import PrefixIndex

    conductor = Conductor(PrefixIndex(), request_ttl=3600.0, clock=SimClock())
    conductor.register_prefill("P", "n1")
    for i in range(5000):
        conductor.schedule([], 64, request_id=f"r{i}")
        conductor.cancel(f"r{i}")
    kept = conductor.schedule([], 64, request_id="kept")
    assert kept.prefill == "P"
    held = conductor.footprint()
    assert held["requests"] == 1 and held["deadlines"] <= 2 + 64, held
    conductor.clock.advance(3601.0)
    assert conductor.expire() == 1  # the live request's deadline survived the compaction


class StuckReplicator:
    """A replicator whose copies never finish until the test says so."""

    def __init__(self):
        self.started: list[Future] = []

    def copy(self, namespace, source, target, digests, first_depth) -> Future:
        self.started.append(Future())
        return self.started[-1]


def test_fetches_copied_at_once_are_bounded():
    """Each fetch's copy held its digests in the replicator's queue until done: Schedules
    deciding fetches faster than nodes copy grew the master."""
    from kvstore.master.conductor_service import MAX_PENDING_COPIES, ConductorServicer
    from kvstore.master.index import DRAM, STORED, PrefixIndex

    index, replicator = PrefixIndex(), StuckReplicator()
    for node_id in ("a", "b"):
        index.add_node(node_id)
    chain = [i.to_bytes(16, "little") for i in range(1, 9)]
    index.apply("a", [("m", [(STORED, DRAM, d) for d in chain])])  # the prefix is on node a only
    servicer = ConductorServicer(index, replicator, SchedulingOptions(admission="off"), lambda *a: None)
    for engine_id, node_id in (("pa", "a"), ("pb", "b")):
        servicer.register_engine(
            pb.EngineRegistration(namespace="m", engine_id=engine_id, role=pb.PREFILL, node_id=node_id)
        )
    servicer.conductor("m").report_load("pa", queue_len=1000, busy_s=1e9)  # a is swamped: b runs and fetches
    request = pb.ScheduleRequest(namespace="m", digests=chain, input_length=8 * 512 + 100)
    for _ in range(MAX_PENDING_COPIES + 6):
        assert servicer.schedule(request).fetch_from_node == "a"
    assert (len(replicator.started), servicer.copies_skipped) == (MAX_PENDING_COPIES, 6)
    replicator.started[0].set_result(8)  # one copy done: room for the next
    servicer.schedule(request)
    assert len(replicator.started) == MAX_PENDING_COPIES + 1
