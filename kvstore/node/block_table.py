"""Per-block state that spans tiers, and per-tier counters."""

from __future__ import annotations

from dataclasses import asdict, dataclass

DRAM = 0
SSD = 1
TIER_NAMES = ("dram", "ssd")


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
