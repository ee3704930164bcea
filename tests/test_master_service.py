"""The master over real gRPC: every RPC, errors, lease expiry, restart and rebuild, metrics."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import grpc
import pytest

from bench import master_index
from kvstore.master.server import MasterServer
from kvstore_client.errors import ConfigError
from kvstore_client.proto import kvstore_pb2 as pb
from kvstore_client.proto import kvstore_pb2_grpc as pb_grpc

NS = "llama3/acme"
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 50),
]


def d(i: int) -> bytes:
    return i.to_bytes(16, "big")


def node_info(node_id: str, machine: str) -> pb.NodeInfo:
    return pb.NodeInfo(
        node_id=node_id,
        host=f"host-{machine}",
        machine_id=machine,
        data_address=f"{machine}:7000",
        metrics_address=f"{machine}:9100",
    )


def report(stub, node_id, digests, tier=pb.DRAM, full=False, kind=pb.BlockEvent.STORED, namespace=NS):
    events = [pb.BlockEvent(kind=kind, tier=tier, digest=x) for x in digests]
    return stub.ReportBlocks(
        pb.BlockReport(
            node_id=node_id, full_inventory=full, batches=[pb.EventBatch(namespace=namespace, events=events)]
        )
    ).known


def dram(capacity, used):
    return [pb.TierStats(tier="dram", capacity=capacity, used=used), pb.TierStats(tier="ssd", capacity=1 << 30)]


@pytest.fixture
def server():
    srv = MasterServer(port=0, ttl_s=30.0, heartbeat_interval_s=1.0, replication_factor=2, metrics_port=0).start()
    yield srv
    srv.stop(0)


@pytest.fixture
def stub(server):
    with grpc.insecure_channel(server.address, options=CHANNEL_OPTIONS) as channel:
        yield pb_grpc.MasterStub(channel)


@pytest.fixture
def cluster(stub):
    """Three nodes: a (m1, 2 GB free), b (m2, 8 GB free), c (m3, 4 GB free); a and b hold a chain."""
    for node_id, machine, used in (("a", "m1", 8), ("b", "m2", 2), ("c", "m3", 6)):
        stub.Register(pb.RegisterRequest(info=node_info(node_id, machine)))
        assert stub.Heartbeat(pb.HeartbeatRequest(node_id=node_id, tiers=dram(10 << 30, used << 30))).known
    chain = [d(i) for i in range(8)]
    assert report(stub, "a", chain[:6])
    assert report(stub, "b", chain[:3], tier=pb.SSD)
    return chain


def test_register_returns_the_lease_terms(stub):
    reply = stub.Register(pb.RegisterRequest(info=node_info("a", "m1")))
    assert (reply.heartbeat_interval_s, reply.ttl_s) == (1.0, 30.0)


def test_heartbeat_and_report_from_unknown_node_say_unknown(stub, server):
    assert not stub.Heartbeat(pb.HeartbeatRequest(node_id="ghost")).known
    assert not report(stub, "ghost", [d(1)])
    assert server.index.size() == 0


def test_locate(stub, cluster):
    reply = stub.Locate(pb.KeyBatch(namespace=NS, digests=[cluster[0], cluster[4], d(99)]))
    located = [{r.node_id: r.tier for r in loc.replicas} for loc in reply.locations]
    assert located == [{"a": pb.DRAM, "b": pb.SSD}, {"a": pb.DRAM}, {}]
    assert [(n.node_id, n.data_address) for n in reply.nodes] == [("a", "m1:7000"), ("b", "m2:7000")]
    assert not stub.Locate(pb.KeyBatch(namespace="other", digests=[cluster[0]])).locations[0].replicas


def test_match_prefix(stub, cluster):
    reply = stub.MatchPrefix(pb.KeyBatch(namespace=NS, digests=cluster))
    assert dict(reply.node_prefix_blocks) == {"a": 6, "b": 3} and reply.longest == 6
    assert stub.MatchPrefix(pb.KeyBatch(namespace=NS, digests=[d(99)])).longest == 0


def test_moves_and_removals_show_up(stub, cluster):
    report(stub, "a", cluster[:1], tier=pb.SSD)
    report(stub, "b", cluster[:1], kind=pb.BlockEvent.REMOVED, tier=pb.TIER_UNSPECIFIED)
    loc = stub.Locate(pb.KeyBatch(namespace=NS, digests=cluster[:1])).locations[0]
    assert [(r.node_id, r.tier) for r in loc.replicas] == [("a", pb.SSD)]


def test_place_local_first_then_most_free(stub, cluster):
    def place(**kw):
        return [n.node_id for n in stub.Place(pb.PlaceRequest(namespace=NS, bytes=1 << 20, **kw)).nodes]

    assert place(machine_id="m1") == ["a", "b"]  # replication factor 2: local, then most free
    assert place(machine_id="nowhere") == ["b", "c"]
    assert place(machine_id="m3", replicas=1) == ["c"]
    assert place(replicas=5) == ["b", "c", "a"]  # best effort


def test_successive_placements_spread_over_equally_free_nodes(stub):
    for node_id in "xyz":
        stub.Register(pb.RegisterRequest(info=node_info(node_id, "m9")))
        stub.Heartbeat(pb.HeartbeatRequest(node_id=node_id, tiers=dram(1 << 30, 0)))
    chosen = [
        stub.Place(pb.PlaceRequest(namespace=NS, bytes=64 << 20, replicas=1, machine_id="m9")).nodes[0].node_id
        for _ in range(6)
    ]
    assert sorted(chosen) == ["x", "x", "y", "y", "z", "z"]  # each placement is charged to its node


def test_a_new_leader_answers_unavailable_for_placements_until_a_node_registers(stub, cluster, server):
    server.reset_state()  # what a master elected leader does: its nodes register again within a TTL
    with pytest.raises(grpc.RpcError) as refused:
        stub.Place(pb.PlaceRequest(namespace=NS, bytes=1 << 20))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # passing: an etcd:// client retries it
    assert "registering" in refused.value.details()
    stub.Register(pb.RegisterRequest(info=node_info("c", "m3")))
    assert stub.Heartbeat(pb.HeartbeatRequest(node_id="c", tiers=dram(10 << 30, 0))).known
    assert [n.node_id for n in stub.Place(pb.PlaceRequest(namespace=NS, bytes=1 << 20)).nodes] == ["c"]


def test_cluster_status(stub, cluster):
    reply = stub.ClusterStatus(pb.ClusterStatusRequest())
    assert reply.indexed_keys == 6 and reply.replication_factor == 2
    by_id = {n.info.node_id: n for n in reply.nodes}
    assert sorted(by_id) == ["a", "b", "c"]
    assert (by_id["a"].indexed_blocks, by_id["b"].indexed_blocks, by_id["c"].indexed_blocks) == (6, 3, 0)
    assert by_id["b"].alive and by_id["b"].seconds_since_heartbeat < 5
    assert by_id["b"].tiers[0].used == 2 << 30 and by_id["a"].info.machine_id == "m1"


def test_list_keys_pages(stub, cluster):
    report(stub, "c", [d(50)], namespace="zz")
    first = stub.ListKeys(pb.ListKeysRequest(namespace=NS, limit=4))
    assert [k.digest for k in first.keys] == cluster[:4] and list(first.namespaces) == [NS, "zz"]
    rest = stub.ListKeys(pb.ListKeysRequest(namespace=NS, limit=4, start_after=first.keys[-1].digest))
    assert [k.digest for k in rest.keys] == cluster[4:6]
    assert {r.node_id for r in first.keys[0].replicas} == {"a", "b"}
    everything = stub.ListKeys(pb.ListKeysRequest())
    assert [(k.namespace, k.digest) for k in everything.keys] == [(NS, x) for x in cluster[:6]] + [("zz", d(50))]


@pytest.mark.parametrize(
    "call, request_",
    [
        ("Locate", pb.KeyBatch(namespace="", digests=[d(1)])),
        ("Locate", pb.KeyBatch(namespace=NS, digests=[b""])),
        ("Locate", pb.KeyBatch(namespace=NS, digests=[b"x" * 65])),
        ("MatchPrefix", pb.KeyBatch(namespace="a\0b", digests=[d(1)])),
        ("MatchPrefix", pb.KeyBatch(namespace="n" * 129, digests=[d(1)])),
        (
            "ReportBlocks",
            pb.BlockReport(
                node_id="a",
                batches=[
                    pb.EventBatch(
                        namespace=NS,
                        events=[pb.BlockEvent(kind=pb.BlockEvent.STORED, tier=pb.TIER_UNSPECIFIED, digest=d(1))],
                    )
                ],
            ),
        ),
        (
            "ReportBlocks",
            pb.BlockReport(
                node_id="a",
                batches=[
                    pb.EventBatch(
                        namespace=NS,
                        events=[pb.BlockEvent(kind=pb.BlockEvent.KIND_UNSPECIFIED, tier=pb.DRAM, digest=d(1))],
                    )
                ],
            ),
        ),
        ("ReportBlocks", pb.BlockReport(node_id="a", batches=[pb.EventBatch(namespace="", events=[])])),
        *[
            ("ReportBlocks", pb.BlockReport(node_id="a", packed=[pb.PackedBlocks(namespace=NS, **bad)]))
            for bad in (
                {"tier": pb.DRAM, "digest_len": 16, "digests": d(1) + b"x"},  # does not split evenly
                {"tier": pb.DRAM, "digest_len": 0, "digests": b""},
                {"tier": pb.DRAM, "digest_len": 65, "digests": b"x" * 65},
                {"tier": pb.TIER_UNSPECIFIED, "digest_len": 16, "digests": d(1)},
            )
        ],
        (
            "ReportBlocks",
            pb.BlockReport(
                node_id="a", packed=[pb.PackedBlocks(namespace="", tier=pb.DRAM, digest_len=16, digests=d(1))]
            ),
        ),
        ("Register", pb.RegisterRequest(info=pb.NodeInfo(node_id=""))),
        *[
            ("Register", pb.RegisterRequest(info=pb.NodeInfo(node_id="new", **bad)))
            for bad in (
                {"data_address": "no-port"},
                {"data_address": "h:0"},
                {"data_address": "h:65536"},
                {"data_address": "h:70x"},
                {"data_address": "two words:7000"},
                {"data_address": "h:7000\n"},
                {"data_address": ":7000"},
                {"metrics_address": "x"},
                {"host": "a\0b"},
                {"machine_id": "m" * 300},
                {"unix_socket": "relative.sock"},
                {"unix_socket": "/" + "s" * 200},
                {"shm_arena": "../etc/passwd"},
                {"arena_pages": "giant"},
            )
        ],
        ("Heartbeat", pb.HeartbeatRequest(node_id="")),
        *[
            ("Heartbeat", pb.HeartbeatRequest(node_id="a", tiers=tiers))
            for tiers in (
                [pb.TierStats(tier="dram", capacity=1 << 63)],
                [pb.TierStats(tier="ssd", used=1 << 61)],
                [pb.TierStats(tier="dram", hits=1 << 63)],
                [pb.TierStats(tier="")],
                [pb.TierStats(tier="dram\n")],
                [pb.TierStats(tier="dram"), pb.TierStats(tier="DRAM")],
                [pb.TierStats(tier=f"t{i}") for i in range(9)],
            )
        ],
        ("Place", pb.PlaceRequest(namespace="")),
        ("ListKeys", pb.ListKeysRequest(namespace="", start_after=d(1))),
    ],
)
def test_invalid_input_is_invalid_argument(stub, cluster, server, call, request_):
    with pytest.raises(grpc.RpcError) as err:
        getattr(stub, call)(request_)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(call + ": ")
    assert server.index.size() == 6  # nothing changed


def test_node_expires_after_ttl_in_real_time():
    # a TTL ten heartbeats long: only the silent node may expire, even on a busy machine
    with (
        MasterServer(port=0, ttl_s=1.0, heartbeat_interval_s=0.1) as srv,
        grpc.insecure_channel(srv.address) as channel,
    ):
        stub = pb_grpc.MasterStub(channel)
        for node_id in ("alive", "silent"):
            stub.Register(pb.RegisterRequest(info=node_info(node_id, node_id)))
            report(stub, node_id, [d(1)])
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            assert stub.Heartbeat(pb.HeartbeatRequest(node_id="alive")).known
            time.sleep(0.1)
        status = stub.ClusterStatus(pb.ClusterStatusRequest())
        assert [n.info.node_id for n in status.nodes] == ["alive"]
        loc = stub.Locate(pb.KeyBatch(namespace=NS, digests=[d(1)])).locations[0]
        assert [r.node_id for r in loc.replicas] == ["alive"]
        assert not stub.Heartbeat(pb.HeartbeatRequest(node_id="silent")).known


def test_master_restart_rebuilds_the_index_from_the_nodes():
    """A node's view: register, report; the master restarts on the same port; rebuild."""
    first = MasterServer(port=0, ttl_s=30.0, heartbeat_interval_s=1.0).start()
    port = first.port
    inventory = [d(i) for i in range(5)]
    with grpc.insecure_channel(first.address, options=CHANNEL_OPTIONS) as channel:
        stub = pb_grpc.MasterStub(channel)
        stub.Register(pb.RegisterRequest(info=node_info("n1", "m1")))
        assert report(stub, "n1", inventory)
        first.stop(0)
        second = MasterServer(port=port, ttl_s=30.0, heartbeat_interval_s=1.0).start()
        try:
            # the same channel reconnects; the new master has never heard of n1
            hb = stub.Heartbeat(pb.HeartbeatRequest(node_id="n1"), wait_for_ready=True, timeout=5)
            assert not hb.known
            assert not stub.Locate(pb.KeyBatch(namespace=NS, digests=inventory[:1])).locations[0].replicas
            stub.Register(pb.RegisterRequest(info=node_info("n1", "m1")))
            assert report(stub, "n1", inventory[:3], full=True)  # a split inventory: replace, then add
            assert report(stub, "n1", inventory[3:])
            assert stub.Heartbeat(pb.HeartbeatRequest(node_id="n1")).known
            reply = stub.Locate(pb.KeyBatch(namespace=NS, digests=inventory))
            assert all([r.node_id for r in loc.replicas] == ["n1"] for loc in reply.locations)
            assert stub.MatchPrefix(pb.KeyBatch(namespace=NS, digests=inventory)).longest == 5
        finally:
            second.stop(0)


def test_second_master_on_a_busy_port_fails(server):
    with pytest.raises(ConfigError):
        MasterServer(port=server.port).start()


def test_metrics_endpoint(server, stub, cluster):
    with pytest.raises(grpc.RpcError):
        stub.Locate(pb.KeyBatch(namespace="", digests=[d(1)]))
    with urllib.request.urlopen(f"http://{server.metrics_address}/metrics", timeout=5) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = resp.read().decode()
    assert "# TYPE kvstore_master_nodes_alive gauge\nkvstore_master_nodes_alive 3\n" in text
    assert "kvstore_master_indexed_keys 6\n" in text
    assert 'kvstore_master_node_keys{node="a",tier="dram"} 6\n' in text
    assert 'kvstore_master_node_keys{node="b",tier="ssd"} 3\n' in text
    assert 'kvstore_master_rpcs_total{method="Register",code="OK"} 3\n' in text
    assert 'kvstore_master_rpcs_total{method="Locate",code="INVALID_ARGUMENT"} 1\n' in text
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"http://{server.metrics_address}/nope", timeout=5)
    assert err.value.code == 404


def test_bench_runs_small(capsys):
    master_index.main(
        ["--chains", "8", "--chain-len", "40", "--batch", "40", "--calls", "4", "--rounds", "1", "--json"]
    )
    result = json.loads(capsys.readouterr().out)
    assert result["indexed_keys"] == 320 and result["entries"] == 480
    assert set(result["keys_per_s"]) >= {"locate_chain", "locate_mixed", "match_prefix"}


def test_a_packed_inventory_replaces_the_nodes_blocks(stub, cluster, server):
    assert stub.Register(pb.RegisterRequest(info=node_info("a", "m1"))).packed_reports
    packed = [
        pb.PackedBlocks(namespace=NS, tier=pb.SSD, digest_len=16, digests=d(7) + d(8) + d(7)),
        pb.PackedBlocks(namespace="zz", tier=pb.DRAM, digest_len=2, digests=b"ab"),
    ]
    assert stub.ReportBlocks(pb.BlockReport(node_id="a", full_inventory=True, packed=packed)).known
    located = stub.Locate(pb.KeyBatch(namespace=NS, digests=[d(1), d(7), d(8)]))
    assert [[(r.node_id, r.tier) for r in loc.replicas] for loc in located.locations] == [
        [("b", pb.SSD)],
        [("a", pb.SSD)],
        [("a", pb.SSD)],
    ]  # a's old blocks gone, b's stay
    assert server.index.node_counts()["a"] == {"dram": 1, "ssd": 2}  # d(7) listed twice, counted once
