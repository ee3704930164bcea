"""What a node's data plane allows one client: the policy half of its resource limits.

- Ops that hold node memory for a client (RESERVE, COMMIT and STORE: reservations and
  grants; LEASE: pinned blocks) are served only over same-host connections, those that
  came in through the node's Unix socket; over TCP they are refused (SAME_HOST_ONLY).
- At most ``max_connections`` connections are served at once; one more gets a BUSY error
  frame and is closed (``Refusals``).
- A connection that sends nothing for ``idle_timeout`` seconds is closed: the kernel's
  receive and send timeouts (SO_RCVTIMEO, SO_SNDTIMEO) end the blocked call, so the hot
  path pays no extra syscall for it.

The numbers are a ``ConnectionLimits`` (below; a node's ``StoreConfig.connections``); the
server and the connections apply them (server.py, connection.py). Spec: proto/dataplane.md,
Connections.
"""

from __future__ import annotations

import collections
import os
import socket
import struct
import time
from dataclasses import dataclass

from kvstore_client.errors import ConfigError
from kvstore_client.wire import FLAG_REPLY, Op, Status, pack_header
from kvstore.units import parse_size

SAME_HOST_OPS = frozenset({Op.RESERVE, Op.COMMIT, Op.STORE, Op.LEASE})
NODE_OPS = frozenset({Op.PULL})  # make the node dial another: not for tenants' tokens
AUTH_TIMEOUT = 10.0  # seconds a connection to a node with an access file has to authenticate
_TIMEVAL = struct.Struct("@ll")  # struct timeval (seconds, microseconds)
_PEERCRED = struct.Struct("3i")  # struct ucred (pid, uid, gid)

MiB = 1 << 20


@dataclass
class ConnectionLimits:
    """What one node's data plane allows its clients (spec: proto/dataplane.md, Connections).

    ``max_connections``: connections served at once, over TCP and the Unix socket together;
    one more is answered with a BUSY error frame and closed. ``idle_timeout``: seconds a
    connection may go without sending a byte (between frames or inside one) before the node
    closes it, releasing what it holds (None: never); a same-host connection that holds
    leases taken with HOLD is exempt between frames (its reader keeps zero-copy views).
    ``max_table_bytes``: the largest item table a request may carry (FRAME_TOO_LARGE past it).
    ``write_ttl``: seconds a RESERVE's space may stay unpublished before the node revokes it
    (a writer filling sliced values layer by layer holds it for one model step; None: never).
    """

    max_connections: int = 1024
    idle_timeout: float | None = 300.0
    max_table_bytes: int | str = 4 * MiB
    write_ttl: float | None = 120.0

    def __post_init__(self) -> None:
        self.max_table_bytes = parse_size(self.max_table_bytes)
        if self.max_connections < 1:
            raise ConfigError(f"max_connections must be at least 1, got {self.max_connections}")
        if self.idle_timeout is not None and not self.idle_timeout > 0:
            raise ConfigError(f"idle_timeout must be positive seconds or None, got {self.idle_timeout!r}")
        if self.write_ttl is not None and not self.write_ttl > 0:
            raise ConfigError(f"write_ttl must be positive seconds or None, got {self.write_ttl!r}")
        if self.max_table_bytes < 4096:
            raise ConfigError(f"max_table_bytes must be at least 4 KiB, got {self.max_table_bytes}")


def same_host(sock: socket.socket) -> bool:
    """Whether a connection came from this host, through the Unix socket, from a process of
    the node's own user or root (peer credentials): those may share its arena, which holds
    every tenant's blocks (and could read the node's memory anyway)."""
    if sock.family != socket.AF_UNIX:
        return False
    _, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return uid in (0, os.getuid())


def set_idle_timeout(sock: socket.socket, seconds: float | None) -> None:
    """Make a blocked recv or send on ``sock`` fail (OSError) after ``seconds`` without progress
    (None: never)."""
    seconds = seconds or 0.0
    whole = int(seconds)
    value = _TIMEVAL.pack(whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


class Refusals:
    """Connections turned away over the cap. Each is sent a BUSY error frame at once and its
    write side shut; it is closed ``GRACE`` seconds later, after draining what it sent
    meanwhile (closing with unread input would reset the connection and could destroy the
    frame before the client reads it). At most ``MAX_WAITING`` wait; past that the oldest is
    closed at once. Called by the accepting threads (``refuse``) and the housekeeping thread
    (``close_due``); the deque's appends and pops are atomic."""

    GRACE = 0.5
    MAX_WAITING = 64

    def __init__(self) -> None:
        self._waiting: collections.deque = collections.deque()  # (close at, socket)
        message = b"node busy: it serves its maximum of connections; try again later"
        self._frame = pack_header(Op.ERROR, 0, 0, len(message), status=Status.BUSY, flags=FLAG_REPLY) + message

    def __len__(self) -> int:
        return len(self._waiting)

    def refuse(self, sock: socket.socket) -> None:
        try:
            sock.setblocking(False)
            sock.send(self._frame)  # a fresh socket's send buffer always has room for it
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            sock.close()
            return
        self._waiting.append((time.monotonic() + self.GRACE, sock))
        while len(self._waiting) > self.MAX_WAITING:
            _close(self._waiting.popleft()[1])

    def close_due(self, now: float | None = None, everything: bool = False) -> None:
        """Close the refused connections whose grace has passed (all with ``everything``)."""
        now = time.monotonic() if now is None else now
        while self._waiting:
            try:
                if not everything and self._waiting[0][0] > now:
                    return
                _, sock = self._waiting.popleft()
            except IndexError:
                return
            _close(sock)


def _close(sock: socket.socket) -> None:
    """Drain what a refused client sent (non-blocking), then close."""
    try:
        while sock.recv(65536):
            pass
    except OSError:
        pass
    sock.close()
