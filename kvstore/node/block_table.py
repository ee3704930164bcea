"""Per-block state that spans tiers, per-tier counters, and the state a store's parts share."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import NamedTuple

from kvstore.sharded import ShardedDict

# The store's own tier numbers: positions in its per-tier lists (policies, counters), not the proto's
# values; at its edge a tier is named (STORE_TIER_NAMES[i]) and the master agent maps the name to the
# proto's value (kvstore_client.tiers.TIER_OF_NAME).
DRAM = 0
SSD = 1
STORE_TIER_NAMES = ("dram", "ssd")


class BlockMeta:
    """One stored block as the store sees it; the bytes live in a tier.

    A new BlockMeta is made on every commit, so code that let go of the store
    lock can tell by identity whether the block it saw is still the current one.
    ``ssd_copy``: a block in DRAM whose SSD record was kept when it was promoted
    (same bytes, same checksum; still an SSD eviction candidate), so demoting it
    again writes nothing.
    """

    __slots__ = ("tier", "size", "depth", "hits", "pins", "ssd_copy")

    def __init__(self, tier: int, size: int, depth: int, hits: int = 0, pins: int = 0):
        self.tier = tier
        self.size = size
        self.depth = depth
        self.hits = hits
        self.pins = pins
        self.ssd_copy = False


@dataclass
class TierCounters:
    """Monotonic event counts of one tier.

    ``demotions`` are blocks this tier moved down a tier, ``promotions`` blocks it
    moved up; ``evictions`` blocks it dropped to make room (not counting moves).
    """

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    demotions: int = 0
    promotions: int = 0
    checksum_failures: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class BlockInfo(NamedTuple):
    """A snapshot of one stored block's state (``BlockStore.describe``)."""

    tier: str  # "dram" or "ssd": where it is served from
    size: int
    depth: int
    hits: int
    pins: int
    ssd_copy: bool  # in DRAM with its SSD record kept since its promotion


class StoreState:
    """What the parts of one BlockStore share: the block table, the tiers, both policies,
    the counters, the listeners; made by the store and handed to its parts (``Tiering``)
    when they are built, so that no part reaches into another's attributes.

    ``lock`` guards ``blocks``, ``policies``, ``counters``, ``usage`` and ``closed`` (it
    is ``BlockStore._lock`` in the store's lock order); the tiers lock themselves. ``emit``
    and ``account`` are called under ``lock``.
    """

    __slots__ = ("lock", "blocks", "dram", "ssd", "policies", "counters", "listeners", "usage", "closed")

    def __init__(self, dram, ssd, policies: list) -> None:
        self.lock = threading.Lock()
        self.blocks: ShardedDict = ShardedDict()  # BlockKey -> BlockMeta
        self.dram = dram  # a kvstore.tiers.dram.DramTier
        self.ssd = ssd  # a kvstore.tiers.ssd.SsdTier, or None
        self.policies = policies  # [DRAM policy, SSD policy]
        self.counters = [TierCounters(), TierCounters()]
        self.listeners: list = []  # (event, key, tier name) -> None, called under lock
        self.usage = None  # told of the bytes held per namespace (BlockStore.track_usage)
        self.closed = False

    def emit(self, event: str, key, tier: int) -> None:
        """Under lock: tell every listener that ``key`` was stored, moved or removed."""
        for listener in self.listeners:
            listener(event, key, STORE_TIER_NAMES[tier])

    def unlist(self, key, meta, tier: int) -> None:
        """Under lock: a block leaves the table for good (removed, evicted, found damaged): its
        bytes leave its namespace's account and listeners hear of it. Every removal path goes
        through here; the caller frees its bytes in the tier."""
        del self.blocks[key]
        self.account(key, -meta.size)
        self.emit("removed", key, tier)

    def account(self, key, delta: int) -> None:
        """Under lock: a block of ``key``'s namespace came, went or changed size."""
        if self.usage is not None and delta:
            self.usage.changed(key[0], delta)
