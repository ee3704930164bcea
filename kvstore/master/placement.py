"""Where a put should go: pure ranking of candidate nodes, no grpc, no state.

Rule (``PlacementPolicy.choose``), primary first, never the same node twice:

1. Local first: the primary is a node on the writer's machine
   (``machine_id`` equal and non-empty), the one with most free DRAM if there
   are several. Locality wins even over a full node: in a cache every node is
   full in steady state and evicts to make room; landing in the writer's own
   DRAM is what makes the put (and the next same-host get) cheap.
2. Otherwise, and for every further replica: most free DRAM bytes first
   (capacity - used from the node's latest heartbeat, minus the bytes placed
   on it since: ``NodeState.dram_free``, so a burst of puts spreads instead
   of piling onto the node that was emptiest a heartbeat ago), ties broken by
   fewer indexed blocks, then by node id (deterministic).
3. Replicas prefer machines not used yet (a second copy on the same machine
   does not survive that machine); only when every machine is used does a
   second node of one machine get picked.
4. ``replicas`` copies (0: the replication factor), best effort: fewer when
   fewer nodes are live.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from kvstore.master.errors import InvalidRequest

MAX_REPLICAS = 64


@dataclass(frozen=True)
class Candidate:
    node_id: str
    machine_id: str
    free_bytes: int
    blocks: int


def _rank_key(c: Candidate) -> tuple:
    return (-c.free_bytes, c.blocks, c.node_id)


class PlacementPolicy:
    """Chooses nodes for a put; stateless apart from the replication factor."""

    def __init__(self, replication_factor: int = 1):
        if not 1 <= replication_factor <= MAX_REPLICAS:
            raise InvalidRequest(f"replication factor must be 1..{MAX_REPLICAS}, got {replication_factor}")
        self.replication_factor = replication_factor

    def choose(self, candidates: Iterable[Candidate], machine_id: str = "", replicas: int = 0) -> list[str]:
        """Node ids for the copies of a put, primary first (see the module doc)."""
        if replicas < 0:
            raise InvalidRequest(f"replicas cannot be negative, got {replicas}")
        wanted = min(replicas or self.replication_factor, MAX_REPLICAS)
        ranked = sorted(candidates, key=_rank_key)
        chosen: list[Candidate] = []
        local = [c for c in ranked if machine_id and c.machine_id == machine_id]
        if local:
            chosen.append(local[0])
        machines = {c.machine_id for c in chosen}
        for c in ranked:  # first pass: new machines only
            if len(chosen) >= wanted:
                break
            if c not in chosen and (not c.machine_id or c.machine_id not in machines):
                chosen.append(c)
                machines.add(c.machine_id)
        for c in ranked:  # second pass: anything left
            if len(chosen) >= wanted:
                break
            if c not in chosen:
                chosen.append(c)
        return [c.node_id for c in chosen[:wanted]]
