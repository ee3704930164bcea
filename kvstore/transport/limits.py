"""What a node's data plane allows one client: the policy half of its resource limits.

- Ops that hold node memory for a client (RESERVE, COMMIT and STORE: reservations and
  grants; LEASE: pinned blocks) are served only over same-host connections, those that
  came in through the node's Unix socket; over TCP they are refused (SAME_HOST_ONLY).
- At most ``max_connections`` connections are served at once; one more gets a BUSY error
  frame and is closed (``Refusals``).
- A connection that sends nothing for ``idle_timeout`` seconds is closed: the kernel's
  receive and send timeouts (SO_RCVTIMEO, SO_SNDTIMEO) end the blocked call, so the hot
  path pays no extra syscall for it.
- On a node with an access file a connection has ``auth_timeout`` seconds, in all, to
  authenticate (TLS handshake included), and at most ``max_unauthenticated`` wait to do so:
  those are counted apart (``PendingConnections``), a new one drops the oldest rather than
  being refused, and they never take a slot from an authenticated client (one more than
  ``max_connections`` drops the oldest unauthenticated one; BUSY only when every slot is
  authenticated). A byte now and then does not stretch the deadline.
- An accept() that fails (out of descriptors: EMFILE) pauses the accepting thread and is
  logged once, not once per try (``AcceptBackoff``).

The numbers are a ``ConnectionLimits`` (below; a node's ``StoreConfig.connections``); the
server and the connections apply them (server.py, connection.py). Spec: proto/dataplane.md,
Connections.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass

from kvstore_client.errors import ConfigError
from kvstore_client.wire import FLAG_REPLY, Op, Status, pack_header
from kvstore.units import parse_size

SAME_HOST_OPS = frozenset({Op.RESERVE, Op.COMMIT, Op.STORE, Op.LEASE})
NODE_OPS = frozenset({Op.PULL})  # make the node dial another: not for tenants' tokens
AUTH_TIMEOUT = 10.0  # seconds, in all, a connection to a service with an access file has to authenticate
MAX_UNAUTHENTICATED = 64  # connections that may wait to authenticate at once (the oldest goes for a new one)
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
    ``auth_timeout``: seconds a connection to a node with an access file has, from accept to
    its last AUTH reply, to authenticate (closed past it, however it trickles bytes).
    ``max_unauthenticated``: such connections waiting to authenticate at once; one more drops
    the oldest of them (see ``PendingConnections``).
    """

    max_connections: int = 1024
    idle_timeout: float | None = 300.0
    max_table_bytes: int | str = 4 * MiB
    write_ttl: float | None = 120.0
    auth_timeout: float = AUTH_TIMEOUT
    max_unauthenticated: int = MAX_UNAUTHENTICATED

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
        if not self.auth_timeout > 0:
            raise ConfigError(f"auth_timeout must be positive seconds, got {self.auth_timeout!r}")
        if self.max_unauthenticated < 1:
            raise ConfigError(f"max_unauthenticated must be at least 1, got {self.max_unauthenticated}")


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


def shutdown_fd(fd: int) -> None:
    """Shut down the socket open at descriptor ``fd``, both ways: the thread blocked in it (a
    recv, a TLS handshake) wakes with an error or EOF. By descriptor, because a TLS wrap moves
    the socket to a new object; the caller must know ``fd`` is still that socket's."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.detach()  # the descriptor stays open: its owner closes it


class PendingConnections:
    """Connections in their opening phase (authenticating; a metrics request being read), by
    descriptor, oldest first. Each must leave the phase within ``timeout`` seconds of entering
    it, however it trickles bytes (a per-recv timeout would let it stretch the phase forever);
    at most ``cap`` are in it at once and a new one drops the oldest. Dropping shuts the
    socket down (``shutdown_fd``), which ends the thread serving it.

    Owners call ``leave(fd)`` when a connection completes the phase (False: it was dropped,
    and must not be served) and before they close a socket that entered: a listed descriptor
    is then always still its socket's. ``expire`` drops those past their deadline: call it
    periodically, or run ``watch`` on a thread of its own. Thread-safe; the lock is held only
    to list, unlist and shut down.
    """

    def __init__(self, cap: int, timeout: float):
        if cap < 1 or not timeout > 0:
            raise ConfigError(f"a pending-connection cap of {cap} and a timeout of {timeout!r} s make no sense")
        self.cap, self.timeout = cap, timeout
        self._lock = threading.Lock()
        self._deadlines: dict[int, float] = {}  # fd -> deadline; oldest first (one timeout for all)
        self._changed = threading.Event()  # wakes ``watch``: a first entry, or stop

    def __len__(self) -> int:
        return len(self._deadlines)

    def enter(self, fd: int, make_room: bool = False) -> None:
        """List ``fd``, dropping the oldest first when ``cap`` are listed, or when ``make_room``
        (the owner's connections are all taken) and any is."""
        with self._lock:
            while self._deadlines and (len(self._deadlines) >= self.cap or make_room):
                self._drop(next(iter(self._deadlines)))
                make_room = False
            first = not self._deadlines
            self._deadlines[fd] = time.monotonic() + self.timeout
        if first:
            self._changed.set()

    def leave(self, fd: int) -> bool:
        """Unlist ``fd``; whether it was still listed (in time, and not dropped for a newer one)."""
        with self._lock:
            return self._deadlines.pop(fd, None) is not None

    def expire(self, now: float | None = None, everything: bool = False) -> int:
        """Drop the connections past their deadline (all with ``everything``); how many."""
        now = time.monotonic() if now is None else now
        dropped = 0
        with self._lock:
            while self._deadlines:
                fd, deadline = next(iter(self._deadlines.items()))
                if deadline > now and not everything:
                    break
                self._drop(fd)
                dropped += 1
        return dropped

    def next_deadline(self) -> float | None:
        """The oldest connection's deadline (time.monotonic()); None when none is listed."""
        with self._lock:
            return next(iter(self._deadlines.values()), None)

    def watch(self, stopped: threading.Event) -> None:
        """Drop each connection at its deadline until ``stopped`` is set (then call ``wake``):
        the loop of a thread for an owner without a periodic thread of its own. It sleeps
        while none is listed."""
        while not stopped.is_set():
            deadline = self.next_deadline()
            self._changed.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
            self._changed.clear()
            self.expire()

    def wake(self) -> None:
        self._changed.set()

    def _drop(self, fd: int) -> None:
        del self._deadlines[fd]
        shutdown_fd(fd)  # under the lock: the owner has not closed it (it leaves first)


_GONE_BEFORE_ACCEPT = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EINTR})


class AcceptBackoff:
    """Paces an accept loop whose accept() fails. A connection gone before it was taken
    (ECONNABORTED) is skipped at once; any other failure (out of descriptors: EMFILE, ENFILE;
    of memory: ENOBUFS, ENOMEM) would fail again at once, so the loop pauses, FIRST seconds
    and twice as long each time up to MOST, and says so once when it starts failing and once
    when accepting works again, instead of spinning and logging every try. For one thread."""

    FIRST, MOST = 0.01, 1.0

    def __init__(self, what: str, logger: logging.Logger):
        self.what, self._log = what, logger
        self.failures = 0
        self._pause = 0.0

    def failed(self, exc: OSError) -> float:
        """Seconds to wait before the next accept() (0: none)."""
        if exc.errno in _GONE_BEFORE_ACCEPT:
            return 0.0
        self.failures += 1
        if self.failures == 1:
            self._log.warning(
                "%s: accept failed (%s); retrying with a pause of up to %.0f s until it works",
                self.what,
                exc.strerror or exc,
                self.MOST,
            )
        self._pause = min(self.MOST, max(self.FIRST, self._pause * 2))
        return self._pause

    def accepted(self) -> None:
        """An accept() worked: back to normal."""
        if self.failures:
            self._log.warning("%s: accepting again after %d failed accepts", self.what, self.failures)
            self.failures, self._pause = 0, 0.0
