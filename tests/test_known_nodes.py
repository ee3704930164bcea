"""KnownNodes: where a client dials each node, refreshed from the master when that goes stale."""

from __future__ import annotations

import logging

from kvstore_client.nodes import KnownNodes
from kvstore_client.proto import kvstore_pb2 as pb


def test_refresh_asks_the_master_at_most_once_a_second():
    nodes, asked = KnownNodes(), []
    old, new = pb.NodeInfo(node_id="n", data_address="h:1"), pb.NodeInfo(node_id="n", data_address="h:2")
    nodes.update([old])

    def live():
        asked.append(1)
        return [new]

    assert nodes.refresh(old, live).data_address == "h:2"
    assert nodes.refresh(old, live).data_address == "h:2" and len(asked) == 1  # not again within a second
    assert nodes.get("n").data_address == "h:2"
    other = pb.NodeInfo(node_id="m", data_address="h:3")
    assert nodes.refresh(other, live) is other and len(asked) == 1  # nor for another node: one call serves all


def test_a_node_the_master_does_not_list_keeps_its_last_info():
    nodes = KnownNodes()
    gone = pb.NodeInfo(node_id="gone", data_address="h:1")
    assert nodes.refresh(gone, lambda: []) is gone


def test_unreachable_warns_once_then_quietly(caplog):
    nodes = KnownNodes()
    with caplog.at_level(logging.DEBUG, logger="kvstore_client.nodes"):
        for _ in range(5):
            nodes.unreachable("n", ConnectionRefusedError("refused"))
        nodes.unreachable("m", ConnectionRefusedError("refused"))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage().split()[1] for r in warnings] == ["n", "m"]
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 4
