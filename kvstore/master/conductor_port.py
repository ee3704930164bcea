"""The master's conductor port: a router's per-request conductor calls over framed TCP.

A router calls ``Schedule`` before each request's prefill, on its time to first token; a gRPC
call from Python costs one to two milliseconds of thread hand-offs on each side, a framed
request on a plain socket a fraction of that. So the master serves the two per-request calls,
``Schedule`` and ``ReportRequest``, on this port too: same protobuf bodies, same conductor, same
checks (spec and the reasons: ``proto/conductor.md``; the codec: ``kvstore_client.conductor_wire``).

One accepting thread and one thread per connection, on blocking sockets; a connection's frames
are answered in order. What a caller may hold is bounded: ``max_connections`` at once (one more
gets BUSY and is closed), ``idle_timeout`` seconds of silence and ``MAX_BODY_BYTES`` a frame,
checked from the header before anything is read; no body is read before a connection has proven
its token. Under an access file a connection has ``auth_timeout`` seconds in all (TLS handshake
included) to authenticate, however it trickles bytes, and at most ``max_unauthenticated`` wait to:
they are listed apart (``transport.limits.PendingConnections``, watched by a thread of their own
that sleeps while none waits), a new one drops the oldest, and they never take a slot from an
authenticated caller (BUSY only when every slot is authenticated). A frame that breaks the format
gets BAD_FRAME and the connection is closed; a body that does not parse is INVALID and the
connection goes on. An accept() that fails (EMFILE) pauses the accepting thread
(``transport.limits.AcceptBackoff``).

Security is the gRPC gate's: with an access file a connection's first frame must be AUTH with a
token of that file (else UNAUTHENTICATED, and closed; a metrics token, which may only scrape,
PERMISSION_DENIED and closed), each call needs a role its gRPC method
admits (``security.grpc_gate.METHOD_ROLES``), and runs as the token's principal, so the
conductor checks its namespace as on gRPC. Under TLS the port is TLS with the master's
certificate. A master on etcd answers UNAVAILABLE while it is not the leader.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from dataclasses import dataclass
from typing import Callable

import grpc
from google.protobuf.message import DecodeError

from kvstore.master.conductor_service import ConductorServicer, ScheduleRejected
from kvstore.master.service import status_for
from kvstore.security.access import ANYONE, SERVICE_ROLES, AccessList, Principal
from kvstore.security.grpc_gate import METHOD_ROLES, serving_as
from kvstore.transport.limits import (
    AUTH_TIMEOUT,
    MAX_UNAUTHENTICATED,
    AcceptBackoff,
    PendingConnections,
    set_idle_timeout,
)
from kvstore_client.auth import DataKey
from kvstore_client.conductor_wire import (
    BODIES,
    GRPC_NAMES,
    HEADER_SIZE,
    MAX_TOKEN_BYTES,
    Method,
    Status,
    pack_header,
    unpack_header,
)
from kvstore_client.errors import (
    ConfigError,
    KVStoreError,
    PermissionDenied,
    ProtocolError,
    Unauthenticated,
    UnknownNamespace,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_IDLE_TIMEOUT_S = 300.0


class _Closing(Exception):
    """End the connection after the reply just sent."""


def status_of(error: KVStoreError) -> Status:
    """The port's status for an error the conductor raised (a rejection has its own, REJECTED)."""
    if isinstance(error, Unauthenticated):
        return Status.UNAUTHENTICATED
    if isinstance(error, PermissionDenied):
        return Status.PERMISSION_DENIED
    if isinstance(error, (ValueError, UnknownNamespace)):
        return Status.INVALID
    return Status.INTERNAL


@dataclass
class _Caller:
    """Who a connection authenticated as: its principal, the key of its token (None: no access
    file) and the access file's generation the token was last found in."""

    principal: Principal
    key: DataKey | None = None
    generation: int = 0


class ConductorPort:
    """Serves ``servicer.schedule`` and ``servicer.report_request`` on ``host:port`` (0: any free
    port). ``count(name, grpc_code)``: the master's RPC counter (calls here count under the gRPC
    method's name). ``serving()``: whether this master may answer now (the leader)."""

    def __init__(
        self,
        servicer: ConductorServicer,
        count: Callable,
        host: str = "127.0.0.1",
        port: int = 0,
        access: AccessList | None = None,
        tls: ssl.SSLContext | None = None,
        serving: Callable[[], bool] = lambda: True,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S,
        auth_timeout: float = AUTH_TIMEOUT,
        max_unauthenticated: int = MAX_UNAUTHENTICATED,
    ):
        self._count = count
        self._access, self._tls, self._serving = access, tls, serving
        self._max_connections, self._idle_timeout, self._auth_timeout = max_connections, idle_timeout, auth_timeout
        # Connections yet to authenticate (under an access file): counted apart, each with a deadline.
        self._pending = PendingConnections(max_unauthenticated, auth_timeout) if access is not None else None
        self._handlers = {Method.SCHEDULE: servicer.schedule, Method.REPORT_REQUEST: servicer.report_request}
        self._listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._host, self._port = host, self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="conductor-port", daemon=True)
        self._watcher = None
        if self._pending is not None:
            watch = self._pending.watch
            self._watcher = threading.Thread(target=watch, args=(self._stopping,), name="conductor-auth", daemon=True)

    @classmethod
    def open(cls, servicer: ConductorServicer, count: Callable, host: str, port: int, **kwargs) -> "ConductorPort":
        """Bind and start serving; ConfigError when the port cannot be had."""
        try:
            served = cls(servicer, count, host, port, **kwargs)
        except OSError as exc:
            raise ConfigError(f"the conductor port cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        served._thread.start()
        if served._watcher is not None:
            served._watcher.start()
        return served

    @property
    def port(self) -> int:
        return self._port

    @property
    def address(self) -> str:
        return f"[{self._host}]:{self._port}" if ":" in self._host else f"{self._host}:{self._port}"

    def connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def stop(self) -> None:
        self._stopping.set()
        if self._pending is not None:
            self._pending.wake()  # its watcher returns
            self._pending.expire(everything=True)
        try:  # shutdown wakes the accepting thread; a close alone leaves it listening
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # -- connections ------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        backoff = AcceptBackoff("conductor port", log)
        while not self._stopping.is_set():
            try:
                sock, peer = self._listener.accept()
            except OSError as exc:
                if self._stopping.is_set():
                    return  # closed by stop()
                pause = backoff.failed(exc)
                if pause and self._stopping.wait(pause):
                    return
                continue
            backoff.accepted()
            if self._stopping.is_set():
                sock.close()
                return
            if self._admit(sock):
                threading.Thread(target=self._serve, args=(sock, peer), name="conductor-conn", daemon=True).start()
            else:
                self._refuse(sock)

    def _admit(self, sock: socket.socket) -> bool:
        """Count ``sock`` in, or False when every slot is taken by an authenticated caller. One
        that must authenticate is listed apart; at the limit it takes the oldest such one's slot."""
        with self._lock:
            full = len(self._conns) >= self._max_connections
            pending = self._pending
            if pending is not None and (not full or len(pending)):
                pending.enter(sock.fileno(), make_room=full)  # listed before its thread starts
                full = False
            if not full:
                self._conns.add(sock)
        return not full

    def _refuse(self, sock: socket.socket) -> None:
        """BUSY to a connection past the limit, from the accepting thread and without waiting
        (a TLS one is closed unanswered: its handshake would wait for the caller)."""
        try:
            if self._tls is None:
                sock.setblocking(False)
                message = f"the conductor port serves {self._max_connections} connections at once".encode()
                sock.send(pack_header(Status.BUSY, 0, len(message)) + message)
        except OSError:
            pass
        finally:
            sock.close()

    def _serve(self, sock: socket.socket, peer) -> None:
        conn, fd = sock, sock.fileno()
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            set_idle_timeout(sock, self._auth_timeout if self._access is not None else self._idle_timeout)
            if self._tls is not None:  # the handshake after the wrap: a failed one leaves the descriptor to us
                conn = self._tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                conn.do_handshake()
            caller = _Caller(ANYONE) if self._access is None else None
            while True:
                caller = self._one_frame(conn, caller)
        except (_Closing, EOFError, OSError, ssl.SSLError):
            pass
        except Exception:  # a bug: this connection ends, the others go on
            log.exception("conductor port: connection from %s failed", peer)
        finally:
            with self._lock:
                self._conns.discard(sock)
            if self._pending is not None:
                self._pending.leave(fd)  # before the close: a listed descriptor is still this socket
            try:
                conn.close()
            except OSError:
                pass

    def _one_frame(self, conn, caller: "_Caller | None") -> "_Caller | None":
        """Read, run and answer one frame; the connection's caller from then on."""
        header = _recv_exactly(conn, HEADER_SIZE)
        try:
            code, request_id, body_len = unpack_header(header)
        except ProtocolError as exc:
            _reply(conn, Status.BAD_FRAME, 0, str(exc).encode())
            raise _Closing from None
        if code == Method.AUTH:
            return self._auth(conn, request_id, body_len, caller)
        if code not in self._handlers:
            _reply(conn, Status.BAD_FRAME, request_id, f"unknown conductor method {code}".encode())
            raise _Closing
        if caller is None:  # before its body: a caller without a token makes the master hold nothing
            _reply(conn, Status.UNAUTHENTICATED, request_id, b"a valid token is required: send AUTH first")
            raise _Closing
        if self._revoked(caller):
            _reply(conn, Status.UNAUTHENTICATED, request_id, b"this token was revoked (the access file changed)")
            raise _Closing
        body = _recv_exactly(conn, body_len)
        status, reply = self._call(Method(code), body, caller.principal)
        _reply(conn, status, request_id, reply)
        return caller

    def _revoked(self, caller: "_Caller") -> bool:
        """Whether the caller's token left the access file, or changed, since it was last checked
        (a reload bumps the generation; only then is the token looked up again)."""
        access = self._access
        if access is None or caller.key is None or caller.generation == access.generation:
            return False
        if access.still_valid(caller.key, caller.principal):
            caller.generation = access.generation
            return False
        return True

    def _auth(self, conn, request_id: int, body_len: int, caller: "_Caller | None") -> "_Caller":
        if body_len > MAX_TOKEN_BYTES:
            _reply(conn, Status.BAD_FRAME, request_id, f"an AUTH body holds at most {MAX_TOKEN_BYTES} bytes".encode())
            raise _Closing
        token = _recv_exactly(conn, body_len).decode("utf-8", "replace")
        if self._access is None:  # no tokens checked here: say so
            _reply(conn, Status.OK, request_id, b"")
            return _Caller(ANYONE)
        found = self._access.bearer(token)
        if found is None or caller is not None:
            message = b"token refused" if found is None else b"AUTH again on an authenticated connection"
            _reply(conn, Status.UNAUTHENTICATED if found is None else Status.BAD_FRAME, request_id, message)
            raise _Closing
        if found.role not in SERVICE_ROLES:
            message = f"token {found.name!r} ({found.role}) may only scrape metrics".encode()
            _reply(conn, Status.PERMISSION_DENIED, request_id, message)
            raise _Closing
        if self._pending is not None and not self._pending.leave(conn.fileno()):
            raise _Closing  # past its deadline, or dropped for a newer one: already shut down
        set_idle_timeout(conn, self._idle_timeout)
        _reply(conn, Status.OK, request_id, found.name.encode())
        return _Caller(found, DataKey.of_token(token), self._access.generation)

    def _call(self, method: Method, body: bytes, principal: Principal) -> tuple[Status, bytes]:
        grpc_name = GRPC_NAMES[method]
        name = grpc_name.split("/", 1)[1]
        if principal.role not in METHOD_ROLES.get(grpc_name, frozenset()):
            return (
                Status.PERMISSION_DENIED,
                f"{name}: token {principal.name!r} ({principal.role}) may not call it".encode(),
            )
        if not self._serving():
            return Status.UNAVAILABLE, f"{name}: this master is not the leader".encode()
        try:
            request = BODIES[method][0].FromString(body)
        except DecodeError:
            return Status.INVALID, f"{name}: the body is not a {BODIES[method][0].__name__}".encode()
        try:
            with serving_as(principal):
                reply = self._handlers[method](request)
        except ScheduleRejected as rejected:
            self._count(name, status_for(rejected))
            return Status.REJECTED, rejected.reply.SerializeToString()
        except KVStoreError as exc:
            self._count(name, status_for(exc))
            return status_of(exc), f"{name}: {exc}".encode()
        except Exception as exc:  # a bug: say so, do not leak a traceback to the caller
            log.exception("conductor port: %s failed", name)
            self._count(name, status_for(exc))
            return Status.INTERNAL, f"{name}: internal error: {type(exc).__name__}".encode()
        self._count(name, grpc.StatusCode.OK)
        return Status.OK, reply.SerializeToString()


def _recv_exactly(conn, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        read = conn.recv_into(view[got:], n - got)
        if not read:
            raise EOFError
        got += read
    return bytes(buf)


def _reply(conn, status: Status, request_id: int, body: bytes) -> None:
    conn.sendall(pack_header(status, request_id, len(body)) + body)
