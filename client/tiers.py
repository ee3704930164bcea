"""The storage tiers, in the one encoding the wire and the master's index share: the values of
the ``Tier`` enum of ``proto/kvstore.proto`` (a test checks they agree), and one name for each.

Importing this module is cheap (no protobuf); ``kvstore_pb2.DRAM`` and ``DRAM`` here are equal.
A storage node's block table numbers its tiers by list position instead (``kvstore.node.block_table``,
``STORE_TIER_NAMES``) and translates at its edge with ``TIER_OF_NAME``.
"""

from __future__ import annotations

DRAM, SSD = 1, 2  # kvstore.proto: enum Tier { TIER_UNSPECIFIED = 0; DRAM = 1; SSD = 2; }
TIER_NAMES: dict[int, str] = {DRAM: "dram", SSD: "ssd"}
TIER_OF_NAME: dict[str, int] = {name: tier for tier, name in TIER_NAMES.items()}
