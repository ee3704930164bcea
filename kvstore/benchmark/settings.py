"""What ``kvstore bench`` measures: the ops, the transports, the settings of a run, the baseline of each op."""

from __future__ import annotations

from dataclasses import dataclass, field

OPS = ("put", "put_nowait", "get", "get_into", "batch_put", "batch_get", "batch_get_into")
TRANSPORTS = ("tcp", "shm")
MiB = 1 << 20

BASELINES = {  # op -> (redis-py measure, redis-benchmark test, batch?, raw socket measure)
    "put": ("redis:set", "set", False, "socket:put"),
    "put_nowait": ("redis:pipe_set", "set", True, "socket:put"),  # Redis's way not to wait: a pipeline
    "batch_put": ("redis:pipe_set", "set", True, "socket:put"),
    "get": ("redis:get", "get", False, "socket:get"),
    "get_into": ("redis:get", "get", False, "socket:get"),
    "batch_get": ("redis:pipe_get", "get", True, "socket:get"),
    "batch_get_into": ("redis:pipe_get", "get", True, "socket:get"),
}


def parse_list(text: str, allowed=None) -> list[str]:
    """The items of a comma-separated option; ValueError names any not in ``allowed``."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if allowed is not None and x not in allowed]
    if bad:
        raise ValueError(f"unknown {', '.join(bad)}; choose from {', '.join(allowed)}")
    return items


@dataclass
class Settings:
    sizes: list[int]
    ops: list[str] = field(default_factory=lambda: list(OPS))
    transports: list[str] = field(default_factory=lambda: list(TRANSPORTS))
    clients: list[int] = field(default_factory=lambda: [1, 4])
    bytes_per_client: int = 64 * MiB  # working set of each client at each size
    batch: int = 64
    rounds: int = 5
    master: str | None = None
    dram: int | None = None  # of the pool started here; None: enough for the working set, twice
    redis: bool = True
    redis_server: str = "redis-server"
    redis_benchmark: str = "redis-benchmark"
    progress: bool = True

    def __post_init__(self) -> None:
        """ValueError, naming the setting, for one that cannot be run (no sizes, zero clients, ...)."""
        for name in ("sizes", "ops", "transports", "clients"):
            if not getattr(self, name):
                raise ValueError(f"{name}: give at least one")
        if any(s <= 0 for s in self.sizes):
            raise ValueError(f"sizes: every value size must be positive (got {', '.join(map(str, self.sizes))})")
        if any(c < 1 for c in self.clients):
            raise ValueError(
                f"clients: every client count must be at least 1 (got {', '.join(map(str, self.clients))})"
            )
        for name in ("bytes_per_client", "batch", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1 (got {getattr(self, name)})")
        if self.dram is not None and self.dram < 1:
            raise ValueError(f"dram must be positive (got {self.dram})")

    def count(self, size: int) -> int:
        """Blocks per client at ``size``: the working set, at least one batch."""
        return max(self.bytes_per_client // size, self.batch)
