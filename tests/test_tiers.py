"""One tier encoding: kvstore_client.tiers holds the proto's Tier values and their names, and the
master's index, the CLI and the node's master agent use it."""

from kvstore_client.proto import kvstore_pb2 as pb
from kvstore_client.tiers import DRAM, SSD, TIER_NAMES, TIER_OF_NAME


def test_the_tiers_are_the_protos_values_with_one_name_each():
    assert (DRAM, SSD) == (pb.DRAM, pb.SSD)
    assert {pb.Tier.Name(t).lower(): t for t in pb.Tier.values() if t} == TIER_OF_NAME
    assert {tier: name for name, tier in TIER_OF_NAME.items()} == TIER_NAMES


def test_the_node_names_its_tiers_as_the_map_does():
    from kvstore.master import index
    from kvstore.node.block_table import STORE_TIER_NAMES

    assert (index.DRAM, index.SSD) == (DRAM, SSD)
    assert set(STORE_TIER_NAMES) == set(TIER_OF_NAME)
