"""Copies blocks between storage nodes when the conductor fetches a prefix.

A Decision that fetches names blocks held by one node and wanted on the
prefill instance's node (hotspot migration). The replicator asks the target
node to PULL them from the source over the data plane, node to node (the
bytes never pass through the master), in worker threads, off the Schedule
call. The copies land through the target's normal reserve/commit path, so
its STORED events update the index like any other write.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from kvstore_client.credentials import NO_CREDENTIALS, Credentials
from kvstore_client.errors import KVStoreError
from kvstore_client.transport import TcpConnection

log = logging.getLogger(__name__)


class Replicator:
    """Runs block copies in a small thread pool; ``address_of(node_id)`` finds a node's data address."""

    def __init__(
        self, address_of: Callable[[str], str | None], credentials: Credentials = NO_CREDENTIALS, workers: int = 2
    ):
        self._address_of = address_of
        self._credentials = credentials  # what the master presents to nodes (a node or admin key)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="master-replicate")
        self.copied_blocks = 0
        self.failed_copies = 0

    def copy(self, namespace: str, source: str, target: str, digests: list[bytes], first_depth: int) -> Future:
        """Copy ``digests`` (a piece of one chain starting at ``first_depth``) from ``source`` to ``target``."""
        return self._pool.submit(self._copy, namespace, source, target, digests, first_depth)

    def _copy(self, namespace: str, source: str, target: str, digests: list[bytes], first_depth: int) -> int:
        src, dst = self._address_of(source), self._address_of(target)
        if src is None or dst is None:
            self.failed_copies += 1
            return 0
        items = [((namespace, d), first_depth + i) for i, d in enumerate(digests)]
        try:
            with TcpConnection(dst, credentials=self._credentials) as target_node:
                copied = sum(target_node.pull_many(src, items))
        except KVStoreError as exc:
            log.warning("replicating %d blocks %s -> %s failed: %s", len(items), source, target, exc)
            self.failed_copies += 1
            return 0
        self.copied_blocks += copied
        return copied

    def stop(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
