"""Node-to-node block copies (the PULL op): this node fetches blocks from another node's
data plane straight into its own DRAM reservations.

Replication (the conductor's hot-prefix fetches, for one) asks the node that
wants the blocks to pull them, so the bytes travel source -> target once and
never through the master. Each block is received into a reservation sized
from the source's reply, verified against the source's checksum, and
committed; a damaged or interrupted one is revoked, so nothing half-copied
becomes visible. Connections to sources are kept for reuse.

Sources are checked before anything is dialled: ``sources(address)`` must
say yes (the node sets it to "a live registered node's data address",
``kvstore.node.peers``; the default, ``refuse_all``, refuses every address), else each item is
answered SOURCE_UNAVAILABLE and no connection is made, so a client cannot
make a node connect wherever it names.

Mechanism only, on the data plane's side: which sources are allowed is the node's policy,
set on ``sources``.

Thread-safe: each data-plane connection thread pulls on a connection of its own.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from kvstore_client.credentials import NO_CREDENTIALS
from kvstore_client.errors import KVStoreError
from kvstore_client.transport import TcpConnection
from kvstore_client.wire import Status, status_of

from kvstore.transport.store_api import ServedStore, WritableBlock

log = logging.getLogger(__name__)
IDLE_PER_SOURCE = 2  # connections kept open to each source node


def refuse_all(address: str) -> bool:
    """The policy of a node with no master: there are no registered nodes to pull from."""
    return False


class BlockPuller:
    """Copies blocks from other nodes into ``store``."""

    def __init__(self, store: ServedStore, timeout: float = 30.0, sources: Callable[[str], bool] = refuse_all):
        self._store = store
        self._timeout = timeout
        self.sources = sources  # which "host:port" this node may pull from
        self.credentials = NO_CREDENTIALS  # what this node presents to the sources (its own token)
        self._idle: dict[str, list[TcpConnection]] = {}
        self._lock = threading.Lock()

    def pull(self, source: str, keys: list, depths: list[int]) -> list[int]:
        """Copy ``keys`` from the node at ``source`` ("host:port"): a wire status per key
        (OK, NOT_FOUND where the source has no such block, SOURCE_UNAVAILABLE, ...).
        A source ``sources`` refuses gets SOURCE_UNAVAILABLE for every key, undialled."""
        if not self.sources(source):
            log.warning(
                "refusing to pull %d blocks from %s: not a live registered node's data address", len(keys), source[:80]
            )
            return [int(Status.SOURCE_UNAVAILABLE)] * len(keys)
        statuses = [int(Status.NOT_FOUND)] * len(keys)
        placed: dict[int, WritableBlock] = {}

        def place(j: int, size: int | None):
            old = placed.pop(j, None)
            if old is not None:
                old.revoke()
            if size is None:
                return None
            try:
                placed[j] = self._store.reserve(keys[j], size, depth=depths[j])
            except KVStoreError as exc:
                statuses[j] = status_of(exc)
                return None
            return placed[j].buffer

        def landed(errors: dict) -> None:
            for j, reservation in placed.items():
                if j in errors:  # damaged in transit, or refused by the source
                    reservation.revoke()
                    statuses[j] = status_of(errors[j])
                    continue
                try:
                    reservation.commit()
                    statuses[j] = Status.OK
                except KVStoreError as exc:
                    statuses[j] = status_of(exc)
            placed.clear()

        try:
            conn = self._connection(source)
            errors = conn.get_with(keys, place, landed)
        except KVStoreError as exc:  # unreachable, or failed mid-transfer: what landed stays
            log.warning("pulling %d blocks from %s failed: %s", len(keys), source, exc)
            for reservation in placed.values():
                reservation.revoke()
            return [s if s != Status.NOT_FOUND else int(Status.SOURCE_UNAVAILABLE) for s in statuses]
        for j, error in errors.items():  # refused by the source (nothing was placed for those)
            statuses[j] = status_of(error)
        self._give_back(source, conn)
        return statuses

    def _connection(self, source: str) -> TcpConnection:
        """A kept connection to ``source`` that still answers a PING (the source may have
        restarted since), else a new one."""
        with self._lock:
            idle = self._idle.get(source)
            kept = idle.pop() if idle else None
        if kept is not None:
            try:
                kept.ping()
                return kept
            except KVStoreError:
                kept.close()
        return TcpConnection(source, timeout=self._timeout, credentials=self.credentials)

    def _give_back(self, source: str, conn: TcpConnection) -> None:
        with self._lock:
            idle = self._idle.setdefault(source, [])
            if len(idle) < IDLE_PER_SOURCE and not conn.closed:
                idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()
