"""The storage nodes a client has heard of, by id: where to dial each one.

Filled from the master's Locate and Place replies. A node that restarts comes
back under the same id on new ports and a new arena, so an address can go
stale: when dialling it fails, ``refresh`` asks the master for every live
node's current one (at most once a second by default, however many nodes fail: nodes
that are down cost the master one call a second per client, not one per
read). ``unreachable`` says so in the log once per node every
``WARN_EVERY_S`` seconds, not on every read.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable

from kvstore_client.proto import kvstore_pb2 as pb

log = logging.getLogger(__name__)

REFRESH_EVERY_S = 1.0
WARN_EVERY_S = 10.0


class KnownNodes:
    """Thread-safe map of node id to NodeInfo, with rate-limited refreshes and warnings.
    ``refresh_every``: seconds between two refreshes at most (default REFRESH_EVERY_S)."""

    def __init__(self, refresh_every: float = REFRESH_EVERY_S) -> None:
        self._lock = threading.Lock()
        self._infos: dict[str, pb.NodeInfo] = {}
        self.refresh_every = refresh_every
        self._refreshed = -refresh_every  # monotonic time of the last refresh
        self._warned: dict[str, float] = {}

    def get(self, node_id: str) -> pb.NodeInfo | None:
        return self._infos.get(node_id)

    def update(self, infos: Iterable[pb.NodeInfo]) -> None:
        with self._lock:
            for info in infos:
                self._infos[info.node_id] = info

    def refresh(self, node: pb.NodeInfo, live_nodes: Callable[[], Iterable[pb.NodeInfo]]) -> pb.NodeInfo:
        """``node``'s current info from ``live_nodes()`` (the master's view; empty when it cannot
        be asked), or the one known here if it was refreshed less than ``refresh_every`` ago."""
        now = time.monotonic()
        with self._lock:
            if now - self._refreshed < self.refresh_every:
                return self._infos.get(node.node_id, node)
            self._refreshed = now
        self.update(live_nodes())
        return self._infos.get(node.node_id, node)

    def unreachable(
        self, node_id: str, error: Exception, consequence: str = "reading other replicas, or a miss"
    ) -> None:
        """Log that ``node_id`` could not be reached, and what the call did about it (a warning
        at most every WARN_EVERY_S)."""
        now = time.monotonic()
        with self._lock:
            loud = now - self._warned.get(node_id, -WARN_EVERY_S) >= WARN_EVERY_S
            if loud:
                self._warned[node_id] = now
        if loud:
            log.warning("node %s unreachable (%s): %s", node_id, error, consequence)
        else:
            log.debug("node %s unreachable (%s)", node_id, error)
