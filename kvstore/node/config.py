"""Configuration of one node's block store.

``ConnectionLimits`` (the data plane's limits per client) is defined by the transport,
which applies them (``kvstore.transport.limits``), and re-exported here because a
``StoreConfig`` carries them to whatever serves the store.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore_client.errors import ConfigError
from kvstore.policy import POLICIES
from kvstore.tiers.lmdb_file import ON_DAMAGE as SSD_DAMAGED
from kvstore.transport.limits import ConnectionLimits
from kvstore.units import format_size, parse_size

__all__ = ["SSD_DAMAGED", "ConnectionLimits", "StoreConfig"]
MiB = 1 << 20


@dataclass
class StoreConfig:
    """What a BlockStore holds and how it makes room.

    Sizes accept ints or strings with units ("8GiB"). ``max_block_bytes`` is
    the largest value accepted; each tier must hold at least one such block.
    Eviction starts when a tier passes ``high_watermark`` of its capacity and
    runs, in batches of ``eviction_batch`` blocks, until it is under
    ``low_watermark``: in a background thread when ``background_eviction``,
    else (and always as a last resort) inline on the put that found no room.
    ``directory_slots`` sizes the block directory that same-host clients read
    without a round trip (None: one slot per 32 KiB of DRAM; 0: none).
    ``connections``: the data plane's limits per node (``ConnectionLimits``), kept here so
    that whatever builds the store hands them to the node's server too.
    ``promote_on_hit`` brings SSD hits back into DRAM; ``keep_ssd_copy`` keeps
    their SSD record meanwhile (inclusive tiers, until SSD space is needed), so
    that demoting them again costs no SSD write. ``ssd_damaged``: what opening an SSD tier
    whose lmdb file is damaged (cut short, not lmdb) does: "refuse" (default: the node does not
    start, and says why) or "move-aside" (the file is renamed beside it and the tier starts empty).
    """

    dram_capacity: int | str = 1 << 30
    ssd_path: str | None = None
    ssd_capacity: int | str = 0
    ssd_sync: bool = False
    ssd_damaged: str = "refuse"
    policy: str = "lru"
    ssd_policy: str | None = None
    max_block_bytes: int | str = 16 * MiB
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    eviction_batch: int = 64
    background_eviction: bool = True
    promote_on_hit: bool = True
    keep_ssd_copy: bool = True
    verify_dram_reads: bool = False
    namespaces: frozenset[str] | None = None
    granule: int = 4096
    prefault: bool = False
    arena_name: str | None = None
    directory_slots: int | None = None
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)

    def __post_init__(self) -> None:
        self.dram_capacity = parse_size(self.dram_capacity)
        self.ssd_capacity = parse_size(self.ssd_capacity)
        self.max_block_bytes = parse_size(self.max_block_bytes)
        if self.ssd_policy is None:
            self.ssd_policy = self.policy
        for name in (self.policy, self.ssd_policy):
            if name not in POLICIES:
                raise ConfigError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}")
        if self.max_block_bytes <= 0:
            raise ConfigError("max_block_bytes must be positive")
        if self.ssd_damaged not in SSD_DAMAGED:
            raise ConfigError(f"ssd_damaged must be one of {list(SSD_DAMAGED)}, got {self.ssd_damaged!r}")
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ConfigError("need 0 < low_watermark <= high_watermark <= 1")
        if self.granule <= 0 or self.granule & (self.granule - 1):
            raise ConfigError("granule must be a power of two")
        if self.directory_slots is not None and self.directory_slots < 0:
            raise ConfigError("directory_slots must be >= 0 (0: no block directory)")
        if self.eviction_batch <= 0:
            raise ConfigError("eviction_batch must be positive")
        granules = -(-self.max_block_bytes // self.granule)
        self._check_tier("dram", self.dram_capacity // self.granule * self.granule, granules * self.granule)
        if self.ssd_path is not None:
            self._check_tier("ssd", self.ssd_capacity, self.max_block_bytes)
        if self.namespaces is not None:
            self.namespaces = frozenset(self.namespaces)

    def _check_tier(self, name: str, capacity: int, block_footprint: int) -> None:
        if capacity < block_footprint:
            raise ConfigError(
                f"{name} tier of {format_size(capacity)} is smaller than one block "
                f"(max_block_bytes {format_size(self.max_block_bytes)}): raise the capacity or lower max_block_bytes"
            )
