"""DataPlaneServer: a node's bulk-bytes endpoint over TCP and a Unix socket.

One accepting thread per listener and one thread per client connection, on
blocking sockets (the fastest way to move bulk bytes from CPython: the
GIL is released inside every send/recv). The frame format is in
``proto/dataplane.md``; the ops in ``kvstore.transport.ops``; per-connection
state and cleanup in ``kvstore.transport.connection``.

Read leases a client has not released expire after ``lease_ttl`` seconds:
a housekeeping thread sweeps every connection's lease table a few times per
TTL, so an idle same-host client (which releases late, with its next
request) cannot pin blocks forever. The same thread keeps the DRAM tier's
block directory marked alive for same-host one-sided readers.

With an access file (``access``) every connection proves a token before
anything else is served, and each key it names is checked against the
token's namespaces (connection.py, auth.py). It has ``auth_timeout`` seconds in
all to do so, and at most ``max_unauthenticated`` connections wait to: they are
listed apart (``limits.PendingConnections``; the housekeeping thread drops those
past their deadline), so they never take the place of authenticated ones.

What one client may hold is bounded (limits.py): at most ``max_connections``
connections at once (one more is refused with a BUSY error frame, unless it can
take the place of one still authenticating), each closed after ``idle_timeout``
seconds without a byte, item tables of at most ``max_table_bytes``, and the ops
that hold node memory (reservations, grants, leases) only over the Unix socket.
An accept() that fails (EMFILE) pauses the accepting thread (``limits.AcceptBackoff``).

Thread-safety: ``start``/``stop`` are for the owner's thread; ``_lock``
guards only the set of live connections (it is never held while calling the
store, nor while the housekeeping thread expires leases). The store does its own locking.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import threading
import time

from kvstore_client.errors import ConfigError
from kvstore_client.hostid import machine_id as this_machine_id
from kvstore_client.wire import MAX_ITEMS, VERSION
from kvstore.security.access import AccessList
from kvstore.transport.allowance import Allowance
from kvstore.transport.connection import Connection
from kvstore.transport.limits import (
    AcceptBackoff,
    ConnectionLimits,
    PendingConnections,
    Refusals,
    set_idle_timeout,
)
from kvstore.transport.ops import end_group
from kvstore.transport.puller import BlockPuller
from kvstore.transport.store_api import ServedStore

log = logging.getLogger(__name__)

MiB = 1 << 20
_UNIX_SOCKET_BUFFER = 4 * MiB  # the kernel caps it at wmem_max / rmem_max
DEFAULT_LEASE_TTL = 2.0  # seconds an unreleased read lease outlives its LEASE request
HOUSEKEEPING_PERIOD = 0.25  # seconds between directory heartbeats (and lease sweeps, at most)
DIRECTORY_LIFETIME = 1.0  # seconds readers trust the block directory after a heartbeat


class DataPlaneServer:
    """Serves ``store``'s blocks (a ``ServedStore``: the node's BlockStore) to SDK clients: TCP on ``host:port``, and a Unix
    socket at ``unix_path`` when given (same-host clients; the shared-memory
    transport uses it as its control channel). Read leases not released within
    ``lease_ttl`` seconds expire (None: never). ``limits``: what each client may hold
    (default: the store config's ``connections``). ``access``: the access file whose tokens
    connections must prove (None: no tokens checked). ``tls``: the context TCP connections
    are served under (None: plain TCP; the Unix socket is always plain). ``usage``: the
    node's TenantUsage, when tenants have quotas."""

    def __init__(
        self,
        store: ServedStore,
        host: str = "127.0.0.1",
        port: int = 0,
        unix_path: str | None = None,
        node_id: str = "",
        machine_id: str = "",
        max_frame_bytes: int | None = None,
        lease_ttl: float | None = DEFAULT_LEASE_TTL,
        limits: ConnectionLimits | None = None,
        access: AccessList | None = None,
        tls: ssl.SSLContext | None = None,
        usage=None,
    ):
        max_block = store.config.max_block_bytes
        if max_frame_bytes is None:
            max_frame_bytes = max(64 * MiB, max_block + MiB)
        if max_frame_bytes < max_block + 4096:
            raise ConfigError(f"max_frame_bytes {max_frame_bytes} cannot carry a block of max_block_bytes {max_block}")
        if lease_ttl is not None and not lease_ttl > 0:
            raise ConfigError(f"lease_ttl must be positive seconds or None, got {lease_ttl!r}")
        self.store = store
        self.puller = BlockPuller(store)  # serves PULL: copies from other nodes
        self.host, self.port = host, port
        self.unix_path = unix_path
        self.node_id = node_id
        self.machine_id = machine_id or this_machine_id()
        self.max_frame_bytes = max_frame_bytes
        self.lease_ttl = lease_ttl
        self.limits = limits or getattr(store.config, "connections", None) or ConnectionLimits()
        self.access = access
        self.tls = tls
        self.usage = usage
        self._refusals = Refusals()
        # Connections yet to authenticate (with an access file): counted apart, each with a deadline.
        self.unauthenticated: PendingConnections | None = None
        if access is not None:
            self.unauthenticated = PendingConnections(self.limits.max_unauthenticated, self.limits.auth_timeout)
            access.subscribe(self._close_revoked)  # a reloaded access file: revoked tokens' connections go
        self.allowance = Allowance(max_frame_bytes)  # RESERVE space past the grant cap, node-wide (ops.py)
        self._stopped = threading.Event()  # wakes the housekeeping thread
        self._listeners: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._connections: dict[Connection, threading.Thread] = {}
        self._lock = threading.Lock()
        self._stopping = False
        self.address = ""

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> "DataPlaneServer":
        tcp = socket.create_server((self.host, self.port), backlog=256, reuse_port=False)
        self._listeners.append(tcp)
        host, port = tcp.getsockname()[:2]
        self.address = f"{host}:{port}"
        if self.unix_path:
            if os.path.exists(self.unix_path):
                os.unlink(self.unix_path)  # a stale socket file from an earlier run
            unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            unix.bind(self.unix_path)
            unix.listen(256)
            self._listeners.append(unix)
        for listener in self._listeners:
            thread = threading.Thread(
                target=self._accept_loop,
                args=(listener,),
                daemon=True,
                name=f"kvstore-dataplane-accept-{listener.family.name}",
            )
            thread.start()
            self._threads.append(thread)
        housekeeper = threading.Thread(target=self._housekeeping, daemon=True, name="kvstore-dataplane-housekeeping")
        housekeeper.start()
        self._threads.append(housekeeper)
        log.info("data plane listening on %s%s", self.address, f" and {self.unix_path}" if self.unix_path else "")
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Close the listeners and every connection (releasing their leases and
        reservations), and wait for the threads. Idempotent."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            live = list(self._connections.items())
        self._stopped.set()
        for listener in self._listeners:
            try:
                listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
            except OSError:
                pass
            listener.close()
        for thread in self._threads:
            thread.join(timeout)
        self._refusals.close_due(everything=True)
        if self.unauthenticated is not None:
            self.unauthenticated.expire(everything=True)  # wakes a TLS handshake too (by descriptor)
        for conn, _ in live:
            conn.shutdown()
        for _, thread in live:
            thread.join(timeout)
        self.puller.close()
        if self.unix_path and os.path.exists(self.unix_path):
            os.unlink(self.unix_path)

    def __enter__(self) -> "DataPlaneServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- what clients learn from INFO ------------------------------------------------------
    def info(self) -> dict:
        arena = self.store.dram.arena  # the DRAM tier's shared-memory arena
        directory = self.store.dram.directory
        return {
            "version": VERSION,
            "node_id": self.node_id,
            "machine_id": self.machine_id,
            "arena": arena.name,
            "arena_path": arena.path,
            "arena_size": arena.size,
            "max_block_bytes": self.store.config.max_block_bytes,
            "max_frame_bytes": self.max_frame_bytes,
            "max_items": MAX_ITEMS,
            "lease_ttl": self.lease_ttl,
            "max_table_bytes": self.limits.max_table_bytes,
            "max_connections": self.limits.max_connections,
            "idle_timeout": self.limits.idle_timeout,
            "write_ttl": self.limits.write_ttl,
            "auth_timeout": self.limits.auth_timeout,
            "max_unauthenticated": self.limits.max_unauthenticated,
            "directory": None if directory is None else directory.name,
        }

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._connections)

    # -- threads ---------------------------------------------------------------------------
    def _accept_loop(self, listener: socket.socket) -> None:
        backoff = AcceptBackoff(f"data plane ({listener.family.name})", log)
        while True:
            try:
                sock, peer = listener.accept()
            except OSError as exc:
                if self._stopping:
                    return
                pause = backoff.failed(exc)
                if pause and self._stopped.wait(pause):
                    return
                continue
            backoff.accepted()
            self._serve_later(sock, peer)

    def _housekeeping(self) -> None:
        """Every quarter second or quarter lease TTL: keep the block directory trusted for
        DIRECTORY_LIFETIME seconds more, and release leases older than the TTL."""
        ttl = self.lease_ttl
        period = HOUSEKEEPING_PERIOD if ttl is None else min(ttl / 4, HOUSEKEEPING_PERIOD)
        directory = self.store.dram.directory
        while True:
            if directory is not None:
                directory.beat(DIRECTORY_LIFETIME)
            if len(self._refusals):
                self._refusals.close_due()
            if self.unauthenticated is not None and len(self.unauthenticated):
                self.unauthenticated.expire()  # past auth_timeout: closed, however they trickle
            if self._stopped.wait(period):
                return
            now = time.monotonic()
            if ttl is not None:
                self._reap_leases(now - ttl)
            if self.limits.write_ttl is not None:
                self._reap_reservations(now - self.limits.write_ttl)

    def _close_revoked(self) -> None:
        """Shut the connections whose token the reloaded access file removed or changed (their
        threads then clean up: leases released, reservations revoked)."""
        revoked = [conn for conn in self._live() if conn.revoked()]
        for conn in revoked:
            conn.shutdown()
        if revoked:
            log.warning("closed %d data-plane connections of revoked tokens", len(revoked))

    def _live(self) -> list[Connection]:
        with self._lock:
            return list(self._connections)

    def _reap_leases(self, cutoff: float) -> None:
        for conn in self._live():
            try:
                conn.leases.expire(cutoff)
            except Exception:  # never let one bad lease stop the sweeps
                log.exception("expiring the leases of data-plane connection %s failed", conn.peer)

    def _reap_reservations(self, cutoff: float) -> None:
        """Revoke RESERVE groups older than write_ttl: a writer that stalls holds no DRAM for long."""
        for conn in self._live():
            try:
                groups = conn.reservations.expire(cutoff)
                for group in groups:
                    end_group(conn, group)
            except Exception:  # never let one bad group stop the sweeps
                log.exception("expiring the reservations of data-plane connection %s failed", conn.peer)
            else:
                if groups:
                    log.info("revoked %d reservations of %s unpublished after write_ttl", len(groups), conn.peer)

    def _serve_later(self, sock: socket.socket, peer) -> None:
        idle = self.limits.idle_timeout
        if self.access is not None:  # until it authenticates (Connection.authenticated)
            auth = self.limits.auth_timeout
            idle = min(idle or auth, auth)
        set_idle_timeout(sock, idle)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        else:  # Unix: raise the small default buffers (TCP autotunes better than any fixed size)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _UNIX_SOCKET_BUFFER)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _UNIX_SOCKET_BUFFER)
        conn = Connection(self, sock, str(peer) or "unix")
        thread = threading.Thread(target=self._serve, args=(conn,), daemon=True, name=f"kvstore-dataplane-{peer}")
        with self._lock:
            if self._stopping:
                sock.close()
                return
            full = len(self._connections) >= self.limits.max_connections
            pending = self.unauthenticated
            if pending is not None and (not full or len(pending)):
                conn.pending_auth = True  # listed before its thread starts: it leaves the list itself
                pending.enter(conn.fd, make_room=full)  # full: the oldest still authenticating goes
                full = False
            if not full:
                self._connections[conn] = thread
        if full:
            log.debug("refusing data-plane connection %s: %d connections served", peer, self.limits.max_connections)
            self._refusals.refuse(sock)
            return
        thread.start()

    def _serve(self, conn: Connection) -> None:
        try:
            conn.serve()
        finally:
            with self._lock:
                self._connections.pop(conn, None)
