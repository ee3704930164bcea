"""Membership (leases, TTL expiry with an injected clock) and placement, as plain Python."""

from __future__ import annotations

import pytest

from kvstore.master.errors import InvalidRequest
from kvstore.master.index import DRAM, STORED, PrefixIndex
from kvstore.master.membership import Membership, NodeIdentity, TierStats
from kvstore.master.placement import Candidate, PlacementPolicy

NS = "ns"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def members(clock) -> Membership:
    return Membership(PrefixIndex(), ttl_s=5.0, clock=clock)


def blocks(*ints):
    return [(NS, [(STORED, DRAM, i.to_bytes(16, "big")) for i in ints])]


def test_register_heartbeat_known(members, clock):
    assert not members.known("a") and not members.heartbeat("a")
    members.register(NodeIdentity("a", host="h", machine_id="m1", data_address="h:1"))
    assert members.known("a") and len(members) == 1
    clock.now += 2
    assert members.heartbeat("a", [TierStats("dram", capacity=100, used=30, blocks=3)])
    state = members.get("a")
    assert state.last_seen == clock.now and state.dram_free() == 70
    assert members.seconds_since(state) == 0
    with pytest.raises(InvalidRequest):
        members.register(NodeIdentity(""))


def test_reregistering_replaces_info_and_starts_a_fresh_session(members):
    members.register(NodeIdentity("a", machine_id="m1"))
    assert members.report("a", blocks(1, 2))
    members.register(NodeIdentity("a", machine_id="m2"))
    assert members.get("a").info.machine_id == "m2" and len(members) == 1
    assert members.index.node_blocks("a") == 0  # waits for the node's inventory
    assert members.report("a", blocks(1), full_inventory=True)
    assert members.index.node_blocks("a") == 1


def test_report_from_unknown_node_is_ignored(members):
    assert not members.report("ghost", blocks(1))
    assert members.index.size() == 0


def test_ttl_expiry_drops_silent_nodes_and_their_blocks(members, clock):
    members.register(NodeIdentity("a"))
    members.register(NodeIdentity("b"))
    members.report("a", blocks(1, 2))
    members.report("b", blocks(2, 3))
    clock.now += 4
    assert members.heartbeat("b")
    clock.now += 1.5  # a: 5.5 s silent, b: 1.5 s
    assert [s.node_id for s in members.live_nodes()] == ["b"]
    assert members.expire() == ["a"]
    assert not members.known("a") and members.known("b")
    assert [dict(h) for h in members.index.locate(NS, [i.to_bytes(16, "big") for i in (1, 2, 3)])] == [
        {},
        {"b": DRAM},
        {"b": DRAM},
    ]
    assert not members.heartbeat("a")  # told to re-register
    assert members.expire() == []


def test_a_report_renews_the_lease(members, clock):
    members.register(NodeIdentity("a"))
    clock.now += 4
    members.report("a", blocks(1))
    clock.now += 4
    assert members.expire() == []
    clock.now += 1.01
    assert members.expire() == ["a"] and members.index.size() == 0


def test_remove(members):
    members.register(NodeIdentity("a"))
    members.report("a", blocks(1))
    assert members.remove("a") and not members.remove("a")
    assert members.index.size() == 0


def test_placed_bytes_count_against_free_dram_until_the_next_heartbeat(members):
    members.register(NodeIdentity("a"))
    members.heartbeat("a", [TierStats("dram", capacity=100, used=30)])
    members.charge(["a", "unknown"], 50)
    assert members.get("a").dram_free() == 20
    members.charge(["a"], 50)
    assert members.get("a").dram_free() == -30  # full, and handed 30 more: ranks below a full node handed less
    members.heartbeat("a", [TierStats("dram", capacity=100, used=100)])  # the writes landed, and are in used
    assert members.get("a").dram_free() == 0


# -- placement ---------------------------------------------------------------------------------


def cand(node_id, machine, free, blocks_=0):
    return Candidate(node_id, machine, free, blocks_)


NODES = [cand("n1", "m1", 10), cand("n2", "m2", 50), cand("n3", "m3", 30), cand("n4", "m2", 40)]


def test_local_first_even_when_fuller():
    assert PlacementPolicy().choose(NODES, machine_id="m3") == ["n3"]
    assert PlacementPolicy().choose(NODES, machine_id="m2") == ["n2"]  # best of the local ones


def test_most_free_without_a_local_node():
    assert PlacementPolicy().choose(NODES, machine_id="elsewhere") == ["n2"]
    assert PlacementPolicy().choose(NODES) == ["n2"]
    tied = [cand("x", "m1", 10, blocks_=5), cand("y", "m2", 10, blocks_=2), cand("z", "m3", 10, blocks_=2)]
    assert PlacementPolicy().choose(tied) == ["y"]  # fewer blocks, then node id


def test_replicas_distinct_primary_first_new_machines_preferred():
    p = PlacementPolicy(replication_factor=3)
    assert p.choose(NODES, machine_id="m1") == ["n1", "n2", "n3"]  # n4 shares m2 with n2
    assert p.choose(NODES, machine_id="m1", replicas=4) == ["n1", "n2", "n3", "n4"]
    assert p.choose(NODES, replicas=2) == ["n2", "n3"]
    assert p.choose(NODES, replicas=10) == ["n2", "n3", "n1", "n4"]  # best effort: every node once
    assert p.choose([], machine_id="m1") == []


def test_placement_rejects_nonsense():
    with pytest.raises(InvalidRequest):
        PlacementPolicy(replication_factor=0)
    with pytest.raises(InvalidRequest):
        PlacementPolicy().choose(NODES, replicas=-1)


# -- a node id is bound to the credential that registered it while its lease is live ----------------


def test_a_live_id_is_refused_to_another_credential_and_nothing_changes(members, clock):
    from kvstore.master.membership import NodeIdInUse

    members.register(NodeIdentity("a", data_address="h:1"), credential="first")
    members.report("a", blocks(1, 2), credential="first")
    for credential, address in (("second", "h:1"), ("second", "h:2"), ("", "h:1"), ("first", "h:2")):
        with pytest.raises(NodeIdInUse, match="'a'"):
            members.register(NodeIdentity("a", data_address=address), credential=credential)
    with pytest.raises(NodeIdInUse):
        members.heartbeat("a", credential="second")
    with pytest.raises(NodeIdInUse):
        members.report("a", [], full_inventory=True, credential="second")
    assert members.get("a").info.data_address == "h:1" and members.index.size() == 2
    members.register(NodeIdentity("a", data_address="h:1"), credential="first")  # its own process again: fine
    assert members.heartbeat("a", credential="first")


def test_the_id_is_free_once_the_lease_lapses(members, clock):
    members.register(NodeIdentity("a", data_address="h:1"), credential="old run")
    clock.now += 5.01  # silent past ttl_s, swept or not: the restarted node takes its id back
    members.register(NodeIdentity("a", data_address="h:2"), credential="new run")
    assert members.heartbeat("a", credential="new run")
    assert members.get("a").info.data_address == "h:2"


def test_forget_all_empties_the_pool_and_waits_one_ttl_for_the_nodes(members, clock):
    assert not members.rejoining()  # a master that never forgot: an empty pool is the real one
    members.register(NodeIdentity("a"))
    members.register(NodeIdentity("b"))
    assert members.report("a", blocks(1, 2))
    members.set_draining("b", True)
    assert members.forget_all() == ["a", "b"]
    assert len(members) == 0 and members.index.node_blocks("a") == 0
    assert members.rejoining()
    members.register(NodeIdentity("b"))
    assert not members.rejoining() and not members.is_draining("b")  # placeable again: the new term's own
    members.remove("b")
    clock.now += 4.9
    assert members.rejoining()
    clock.now += 0.1
    assert not members.rejoining()  # a node silent for a whole TTL is not coming back
