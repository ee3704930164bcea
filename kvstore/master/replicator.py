"""Copies blocks between storage nodes when the conductor fetches a prefix.

A Decision that fetches names blocks held by one node and wanted on the
prefill instance's node (hotspot migration). The replicator reads them from
the source node and writes them to the target over the data plane, in
worker threads, off the Schedule call. The copy lands through the target's
normal put path, so its STORED events update the index like any other write.
The bytes pass through the master process on the way (it keeps none);
a node-to-node pull would save that hop.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from kvstore_client.transport import TcpConnection

log = logging.getLogger(__name__)


class Replicator:
    """Runs block copies in a small thread pool; ``address_of(node_id)`` finds a node's data address."""

    def __init__(self, address_of: Callable[[str], str | None], workers: int = 2):
        self._address_of = address_of
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
        keys = [(namespace, d) for d in digests]
        try:
            with TcpConnection(src) as reader, TcpConnection(dst) as writer:
                values = reader.get_many(keys)
                items = [(k, v, first_depth + i) for i, (k, v) in enumerate(zip(keys, values)) if v is not None]
                errors = writer.put_many(items) if items else []
        except OSError as exc:
            log.warning("replicating %d blocks %s -> %s failed: %s", len(keys), source, target, exc)
            self.failed_copies += 1
            return 0
        copied = sum(e is None for e in errors)
        self.copied_blocks += copied
        return copied

    def stop(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

