"""A node id claimed in etcd, so that it names one process cluster-wide whichever master leads.

With ``--master etcd://...`` a node puts ``PREFIX/nodes/<node_id>`` = its holder string (a
random incarnation and its data address) on an etcd lease of its own, only if the key is
absent, keeps the lease alive (every third of its TTL) and revokes it when it stops
cleanly. A second process with the same id (a copied data directory, say) finds the key
held and waits until it is free: the first one stopped, or, after a kill -9, its lease
lapsed (``ttl_s``). A master binds a node id to the process that registered it only while
it leads (kvstore.master.membership); the claim keeps the id unique across leader changes
too, since a new leader starts knowing no node.

Thread-safety: ``acquire`` and ``release`` are called by the node's start and stop; the
keep-alive thread only touches the lease it was started with.
"""

from __future__ import annotations

import logging
import threading
import time

from kvstore_client.etcd import Etcd, EtcdUnavailable

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 5


def claim_key(prefix: str, node_id: str) -> bytes:
    return f"{prefix.rstrip('/')}/nodes/{node_id}".encode()


class NodeIdClaim:
    """Holds ``node_id`` in etcd for this process while it runs."""

    def __init__(self, etcd: Etcd, prefix: str, node_id: str, holder: str, ttl_s: int = DEFAULT_TTL_S):
        self._etcd = etcd
        self.key = claim_key(prefix, node_id)
        self.node_id = node_id
        self._holder = holder.encode()
        self._ttl_s = ttl_s
        self._lease: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.held_by: str | None = None  # who holds the id while this process waits for it

    def acquire(self, timeout: float | None = None, poll_s: float = 0.5, cancelled=lambda: False) -> bool:
        """Claim the id, waiting while another process holds it (saying so once); False if
        still held after ``timeout`` seconds or once ``cancelled()``. EtcdUnavailable if etcd
        cannot be reached."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            holder = self._try_claim()
            if holder is None:
                self._thread = threading.Thread(target=self._keep_alive, name="node-id-claim", daemon=True)
                self._thread.start()
                return True
            if self.held_by != holder:
                log.warning(
                    "node id %s is held in etcd by another process (%s): waiting until it is free (that process "
                    "stops, or its lease lapses within %d s of its death)",
                    self.node_id,
                    holder,
                    self._ttl_s,
                )
            self.held_by = holder
            if cancelled() or (deadline is not None and time.monotonic() >= deadline):
                return False
            if self._stop.wait(poll_s):
                return False

    def release(self) -> None:
        """Give the id up (a clean stop): the next process with it claims it at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._lease is not None:
            try:
                self._etcd.revoke(self._lease)
            except EtcdUnavailable as exc:
                log.info("could not revoke the node id claim (%s): it lapses within %d s", exc, self._ttl_s)
            self._lease = None

    def _try_claim(self) -> str | None:
        """Put the key on a new lease if absent (or already ours): None, else who holds it."""
        lease, _ttl = self._etcd.grant(self._ttl_s)
        created, kv = self._etcd.create(self.key, self._holder, lease)
        if created:
            self._lease, self.held_by = lease, None
            return None
        self._etcd.revoke(lease)
        if kv is not None and kv.value == self._holder:  # ours, on the lease we hold
            return None
        return kv.value.decode(errors="replace") if kv is not None else "?"

    def _keep_alive(self) -> None:
        while not self._stop.wait(self._ttl_s / 3):
            try:
                if self._etcd.keep_alive(self._lease) > 0:
                    continue
                holder = self._try_claim()  # the lease lapsed (etcd out of reach too long): claim again
                if holder is not None:
                    log.error(
                        "node id %s was claimed in etcd by another process (%s) while this one could not "
                        "renew its claim",
                        self.node_id,
                        holder,
                    )
                    return
            except EtcdUnavailable as exc:
                log.warning("cannot renew the node id claim in etcd (%s); retrying", exc)
