"""Draining a live node: an operator takes it out of service without losing what only it holds.

``Drainer.start(node_id)`` marks the node draining in the Membership (Place skips it from
then on, and what it reports is no longer indexed), finds the blocks no other node holds,
and asks other nodes to PULL them from it (the Replicator: node to node, the bytes never
pass through the master), spread over the placeable nodes most free first. When the copies
are done (or failed) the node's entries leave the index, so readers go to the copies. The
node keeps serving meanwhile, and afterwards until it is stopped (its clean stop
deregisters it); ``cancel`` puts it back in service, and its next full inventory (after a
restart or a lapsed lease) is indexed again.

Drain state lives in the master's memory like the rest of membership: a master that
restarts has forgotten it (drain again).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import wait

from kvstore.master.membership import Membership
from kvstore.master.replicator import Replicator

log = logging.getLogger(__name__)

COPY_CHUNK = 1000  # blocks a PULL request
INDEXED_WAIT_S = 5.0  # at most this long for copies to show in the index before the node's entries go


class Drainer:
    """Runs drains, one background thread each; thread-safe."""

    def __init__(self, membership: Membership, replicator: Replicator):
        self._membership = membership
        self._index = membership.index
        self._replicator = replicator
        self._lock = threading.Lock()
        self._runs: dict[str, threading.Thread] = {}

    def start(self, node_id: str) -> tuple[int, int] | None:
        """Begin draining; (blocks indexed for the node, blocks only it holds: being copied),
        or None if the node is unknown. Draining a draining node starts nothing new."""
        if not self._membership.set_draining(node_id, True):
            return None
        entries = self._index.node_keys(node_id)
        only_here = []
        for namespace, digests in entries:
            holders = self._index.locate(namespace, digests)
            sole = [d for d, h in zip(digests, holders) if all(n == node_id for n, _tier in h)]
            if sole:
                only_here.append((namespace, sole))
        total, copying = sum(len(d) for _, d in entries), sum(len(d) for _, d in only_here)
        with self._lock:
            if node_id in self._runs and self._runs[node_id].is_alive():
                return total, copying
            run = threading.Thread(target=self._drain, args=(node_id, only_here), name=f"drain-{node_id}", daemon=True)
            self._runs[node_id] = run
        run.start()
        log.info("draining node %s: %d blocks indexed, %d held by no other node", node_id, total, copying)
        return total, copying

    def cancel(self, node_id: str) -> bool:
        """Put a node back in service; False if unknown."""
        return self._membership.set_draining(node_id, False)

    def wait(self, node_id: str, timeout: float | None = None) -> bool:
        """Wait for a drain's copies and index update; True once none is running for the node."""
        with self._lock:
            run = self._runs.get(node_id)
        if run is not None:
            run.join(timeout)
        return run is None or not run.is_alive()

    def _drain(self, node_id: str, only_here: list[tuple[str, list[bytes]]]) -> None:
        targets = [
            s.node_id
            for s in sorted(self._membership.placeable_nodes(), key=lambda s: -s.dram_free())
            if s.node_id != node_id
        ]  # most free DRAM first
        if only_here and not targets:
            log.warning("draining node %s: no other node to copy its blocks to; they leave the index", node_id)
        futures, turn = [], 0
        for namespace, digests in only_here if targets else ():
            for start in range(0, len(digests), COPY_CHUNK):
                target = targets[turn % len(targets)]
                turn += 1
                futures.append(
                    self._replicator.copy(
                        namespace, node_id, target, digests[start : start + COPY_CHUNK], first_depth=0
                    )
                )
        wait(futures)
        copied = sum(f.result() for f in futures if f.exception() is None)
        if copied:  # the targets report their copies within their flush interval: let them land first
            deadline = time.monotonic() + INDEXED_WAIT_S
            while time.monotonic() < deadline and not self._held_elsewhere(node_id, only_here):
                time.sleep(0.05)
        if self._membership.is_draining(node_id) and self._membership.known(node_id):  # not cancelled, not gone
            self._index.reset_node(node_id)
        log.info("drained node %s: %d blocks copied to other nodes, its entries left the index", node_id, copied)

    def _held_elsewhere(self, node_id: str, blocks: list[tuple[str, list[bytes]]]) -> bool:
        return all(
            any(n != node_id for n, _tier in h)
            for namespace, digests in blocks
            for h in self._index.locate(namespace, digests)
        )
