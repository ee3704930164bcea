"""One client connection of a data-plane server, served by its own thread.

The thread reads a frame, runs its op (``kvstore.transport.ops``), sends the
reply, and repeats, so pipelined requests are answered in order. A
frame-level error (bad magic, unknown op, inconsistent table...) gets an
ERROR reply and ends the connection, because the byte stream can no longer
be trusted to be in sync; other connections are unaffected.

The connection owns its lease and reservation tables. Reservations are
touched only by its thread; leases are also expired by the server's housekeeping
thread, so they live in a thread-safe ``LeaseTable`` (leases.py).
When the connection ends, however it ends, every lease is released and every
open reservation revoked (so a client that dies mid-PUT leaves nothing
half-written and no DRAM held).

On a node with an access file a connection is served nothing but AUTH until
it has proven a token (kvstore.transport.auth); from then on every key of
every table is checked against the token's namespaces (``admitted``). Until
then it is on the server's list of connections authenticating
(``server.unauthenticated``), which shuts it down at its deadline or for a newer
one; it leaves the list when it authenticates, or before it closes its socket.
A token of a role that may not use the data plane (metrics) is refused.

What it holds before a client's bytes arrive is bounded: nothing is sized from a
header alone (tables are gathered as they arrive, up to ``max_table_bytes``),
the ops that hold node memory are refused over TCP (``limits.SAME_HOST_OPS``),
and a client silent for the idle timeout is dropped (the socket's own timeouts,
set by the server: a blocked recv or send then fails with an OSError).
"""

from __future__ import annotations

import logging
import socket
import ssl
from typing import TYPE_CHECKING

from kvstore_client.errors import ProtocolError, TransportError
from kvstore_client.wire import (
    FLAG_REPLY,
    HEADER_SIZE,
    MAX_ITEMS,
    FrameReader,
    Op,
    Status,
    pack_header,
    parse_table,
    send_buffers,
    status_of,
    unpack_header,
)
from kvstore.security.access import ANYONE, SERVICE_ROLES, TENANT, Principal
from kvstore.transport.leases import LeaseTable
from kvstore.transport.limits import NODE_OPS, SAME_HOST_OPS, same_host, set_idle_timeout
from kvstore.transport.ops import OPS, end_group
from kvstore.transport.reservations import ReservationTable

if TYPE_CHECKING:
    from kvstore.transport.server import DataPlaneServer

log = logging.getLogger(__name__)

_LINGER_SECONDS, _LINGER_BYTES = 0.5, 64 << 20  # input drained after an error reply, at most
_MAX_ADMITTED = 4096  # namespaces whose verdict a connection remembers
_DENIED = int(Status.PERMISSION_DENIED)


class Frame:
    """A request header, as the ops see it."""

    __slots__ = ("op", "flags", "request_id", "count", "body_len")

    def __init__(self, op: int, flags: int, request_id: int, count: int, body_len: int):
        self.op, self.flags, self.request_id, self.count, self.body_len = op, flags, request_id, count, body_len


class Connection:
    """Serves one client socket from one thread; see the module docstring. Only ``leases``
    is touched by another thread (the server's housekeeping thread)."""

    def __init__(self, server: "DataPlaneServer", sock: socket.socket, peer: str):
        self.server = server
        self.store = server.store
        self.sock = sock
        self.fd = sock.fileno()  # the same under TLS: how server.unauthenticated knows it
        self.peer = peer
        self.reader = FrameReader(sock)
        self.max_frame_bytes = server.max_frame_bytes
        self.max_table_bytes = server.limits.max_table_bytes
        self.same_host = same_host(sock)
        self.leases = LeaseTable()  # also expired by the server's housekeeping thread
        self.reservations = ReservationTable()  # also expired by the server's housekeeping thread
        self._next_id = 0
        # Who the client is: ANYONE on a node without an access file, else None until AUTH succeeds.
        self.principal: Principal | None = ANYONE if server.access is None else None
        self.pending_proof = None  # kvstore.transport.auth.PendingProof between the two AUTH frames
        self.pending_auth = False  # on server.unauthenticated (set by the server before serve() starts)
        self._confined = False
        self._admitted: dict[str, bool] = {}
        self._key = None  # the DataKey it authenticated with: checked again when the access file is reloaded
        self._generation = 0  # the access file's generation its token was last found valid in

    def authenticated(self, principal: Principal, key=None) -> None:
        """The client proved its token (transport/auth.py): serve it, within its namespaces.
        PERMISSION_DENIED for a role that may not use the data plane; UNAUTHENTICATED when the
        connection was dropped meanwhile (past its deadline, or for a newer one)."""
        if principal.role not in SERVICE_ROLES:
            raise ProtocolError(
                f"token {principal.name!r} ({principal.role}) may only scrape metrics, not use the data plane",
                Status.PERMISSION_DENIED,
            )
        if self.pending_auth:
            self.pending_auth = False
            if not self.server.unauthenticated.leave(self.fd):
                raise ProtocolError("authentication took longer than the node allows", Status.UNAUTHENTICATED)
        self.principal = principal
        self._confined = principal.confined
        self._key, self._generation = key, self.server.access.generation
        set_idle_timeout(self.sock, self.server.limits.idle_timeout)  # the handshake's shorter one ends

    def revoked(self) -> bool:
        """Whether the token this connection authenticated with left the access file, or changed
        (role, namespaces, quota), since it was last checked."""
        access = self.server.access
        if self._key is None or access.generation == self._generation:
            return False
        if access.still_valid(self._key, self.principal):
            self._generation = access.generation
            return False
        return True

    def admitted(self, key):
        """``key`` if the connection's token may use its namespace, else PERMISSION_DENIED (an
        item status); an int (an item status already) passes through."""
        if not self._confined or type(key) is int:
            return key
        verdict = self._admitted.get(key[0])
        if verdict is None:
            if len(self._admitted) >= _MAX_ADMITTED:
                self._admitted.clear()
            verdict = self._admitted[key[0]] = self.principal.may_use(key[0])
        return key if verdict else _DENIED

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def issued(self, some_id: int) -> bool:
        """Whether this connection ever handed out ``some_id`` (lease and reservation ids share one counter)."""
        return 0 < some_id <= self._next_id

    # -- the loop ---------------------------------------------------------------------
    def serve(self) -> None:
        request_id, op = 0, Op.ERROR
        try:
            if self.server.tls is not None and not self.same_host:
                self._start_tls()
            while True:
                request_id, op = 0, Op.ERROR  # what an error reply echoes until a header parses
                if not self._wait():
                    return  # closed between frames
                op, _, flags, request_id, count, body_len = unpack_header(self.reader.read(HEADER_SIZE))
                if self._key is not None and self.revoked():  # the access file was reloaded without it
                    raise ProtocolError("this token was revoked (the access file changed)", Status.UNAUTHENTICATED)
                if self.principal is None and op != Op.AUTH:  # before anything else, unknown ops too
                    raise ProtocolError(
                        "this node checks tokens: authenticate first (AUTH; the SDK's "
                        "Client(token=...) or KVSTORE_TOKEN)",
                        Status.UNAUTHENTICATED,
                    )
                handler = OPS.get(op)
                if handler is None:
                    raise ProtocolError(f"unknown op {op}", Status.UNSUPPORTED)
                if op in NODE_OPS and self.principal.role == TENANT:
                    raise ProtocolError(
                        f"{Op(op).name} is for nodes and admins; token {self.principal.name!r} is a tenant's",
                        Status.PERMISSION_DENIED,
                    )
                if op in SAME_HOST_OPS and not self.same_host:
                    raise ProtocolError(
                        f"{Op(op).name} holds node memory: same host only (the node's Unix socket), not over TCP",
                        Status.SAME_HOST_ONLY,
                    )
                self._check_size(count, body_len)
                handler(self, Frame(op, flags, request_id, count, body_len))
        except ProtocolError as exc:
            self._send_error(request_id, exc.status, str(exc))
        except (TransportError, OSError) as exc:
            log.debug("data-plane connection %s ended: %s", self.peer, exc)
        except Exception as exc:  # a bug: say so to the client, keep serving everyone else
            log.exception("data-plane connection %s failed serving op %s", self.peer, op)
            self._send_error(request_id, status_of(exc), f"{type(exc).__name__}: {exc}")
        finally:
            self.close()

    def _start_tls(self) -> None:
        """The TLS handshake, in this connection's thread (a slow client delays no one else).
        The socket is wrapped first and shaken hands with after, so a failed handshake leaves
        its descriptor open for ``close`` (which unlists it first)."""
        from kvstore_client.tls import TLSSocket

        try:
            tls = self.server.tls.wrap_socket(self.sock, server_side=True, do_handshake_on_connect=False)
            self.sock = TLSSocket(tls)
            tls.do_handshake()
        except (ssl.SSLError, OSError, ValueError) as exc:
            raise TransportError(f"TLS handshake failed: {exc}") from None
        self.reader = FrameReader(self.sock)

    def _wait(self) -> bool:
        """Wait for the next frame; False when the client closed. Past the idle timeout the
        recv fails (OSError: the connection ends), unless this connection holds leases taken
        with HOLD: their reader keeps zero-copy views into the arena, so it waits on."""
        while True:
            try:
                return self.reader.wait()
            except (BlockingIOError, TimeoutError):
                if not self.leases.held:
                    raise

    def _check_size(self, count: int, body_len: int) -> None:
        if body_len > self.max_frame_bytes:
            raise ProtocolError(
                f"frame body of {body_len} bytes exceeds max_frame_bytes {self.max_frame_bytes}", Status.FRAME_TOO_LARGE
            )
        if count > MAX_ITEMS:
            raise ProtocolError(f"{count} items in one frame; at most {MAX_ITEMS}", Status.FRAME_TOO_LARGE)

    # -- helpers for ops ------------------------------------------------------------------
    def read_table(self, frame: Frame, fixed, consumed: int = 0) -> list[tuple]:
        """Read and parse the rest of a frame body (after the ``consumed`` bytes the op read
        first): an item table of ``fixed``-headed key entries."""
        size = frame.body_len - consumed
        self.check_table(size)
        entries = parse_table(self.reader.read(size), frame.count, fixed)
        if self._confined:
            admitted = self.admitted
            entries = [(admitted(key), fields) for key, fields in entries]
        return entries

    def check_table(self, size: int) -> None:
        """FRAME_TOO_LARGE for an item table past ``max_table_bytes``."""
        if size > self.max_table_bytes:
            raise ProtocolError(
                f"item table of {size} bytes exceeds max_table_bytes {self.max_table_bytes}", Status.FRAME_TOO_LARGE
            )

    def reply(self, frame: Frame, count: int, *parts) -> None:
        """Send a reply frame whose body is ``parts`` (bytes-like) in order."""
        if len(parts) == 1 and type(parts[0]) in (bytes, bytearray):  # the common small reply: one send
            body = parts[0]
            self.sock.sendall(pack_header(frame.op, frame.request_id, count, len(body), flags=FLAG_REPLY) + body)
            return
        body_len = sum(memoryview(p).nbytes for p in parts)
        head = pack_header(frame.op, frame.request_id, count, body_len, flags=FLAG_REPLY)
        if len(parts) <= 1:
            self.sock.sendall(head + bytes(parts[0]) if parts else head)
        else:
            send_buffers(self.sock, [head, *parts])

    def _send_error(self, request_id: int, status: int, message: str) -> None:
        """Send an ERROR frame, then close gently: closing with unread input would reset the
        connection and could destroy the reply before the client reads it."""
        body = message.encode()[:4096]
        try:
            self.sock.sendall(pack_header(Op.ERROR, request_id, 0, len(body), status=status, flags=FLAG_REPLY) + body)
            self.sock.shutdown(socket.SHUT_WR)
            self.sock.settimeout(_LINGER_SECONDS)
            scratch, drained = bytearray(65536), 0
            while drained < _LINGER_BYTES:
                got = self.sock.recv_into(scratch)
                if not got:
                    break
                drained += got
        except OSError:
            pass

    # -- teardown ---------------------------------------------------------------------------
    def close(self) -> None:
        """Release every lease, revoke every open reservation, close the socket (idempotent)."""
        if self.pending_auth:  # off the list before the descriptor can be reused
            self.pending_auth = False
            self.server.unauthenticated.leave(self.fd)
        self.leases.release_all()
        for group in self.reservations.drain():
            try:
                end_group(self, group)
            except Exception:  # store already closed: nothing to give back
                pass
        try:
            self.sock.close()
        except OSError:
            pass

    def shutdown(self) -> None:
        """Wake the serving thread from another thread (server stop): it then cleans up."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
