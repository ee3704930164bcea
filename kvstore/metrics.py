"""A small Prometheus exporter: GET /metrics in text format 0.0.4.

    server = MetricsServer(0, collect)        # port 0: any free port
    server.address                            # "127.0.0.1:54321"
    server.stop()

``collect()`` returns samples ``(name, help, type, labels, value)``, where type
is "gauge", "counter" or "untyped" and labels a dict (may be empty). It is
called once per scrape, on the connection's thread, so it must be
thread-safe; samples sharing a name are grouped under one HELP/TYPE header
(the first sample's help and type). A collect() that raises answers 500.
Used by the master and the storage node.

Whoever reaches the port can connect, so what a connection may hold is
bounded: at most ``max_connections`` at once, each served by a thread of its
own (one more drops the oldest connection still sending its request; when all
are being answered, the new one is closed at once); ``timeout`` seconds for
each read and, in all, from accept to the end of the request (TLS handshake
included: a request trickled a byte at a time is closed at its deadline,
``transport.limits.PendingConnections``); one request per connection. An
accept() that fails (EMFILE) pauses accepting, logged once
(``transport.limits.AcceptBackoff``). With ``tls`` (the service's server
context) the port speaks HTTPS only, so a scrape's token never travels in clear.

The accepting thread sleeps in ``select`` until a client connects, a deadline
falls due or ``stop()`` writes to a pipe: an idle exporter does not wake up,
and stops at once. Threads and daemon threads only: a process never waits for
them at exit.
"""

from __future__ import annotations

import logging
import math
import os
import selectors
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import Callable, Iterable, Mapping

from kvstore.security.access import SCRAPE_ROLES
from kvstore.transport.limits import AcceptBackoff, PendingConnections

log = logging.getLogger(__name__)

Sample = tuple[str, str, str, Mapping[str, str], float]
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TYPES = ("counter", "gauge", "untyped", "summary", "histogram")
DEFAULT_MAX_CONNECTIONS = 32  # Prometheus and a probe or two; a flood drops its own oldest
DEFAULT_TIMEOUT_S = 10.0  # Prometheus' default scrape timeout


def _escape_label(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _format_value(value: float) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def render(samples: Iterable[Sample]) -> str:
    """Prometheus text exposition (format 0.0.4) of ``samples``."""
    groups: dict[str, list[Sample]] = {}
    for sample in samples:
        groups.setdefault(sample[0], []).append(sample)
    lines = []
    for name, group in groups.items():
        _, help_text, kind, _, _ = group[0]
        lines.append(f"# HELP {name} {_escape_help(help_text)}")
        lines.append(f"# TYPE {name} {kind if kind in TYPES else 'untyped'}")
        for _, _, _, labels, value in group:
            if labels:
                body = ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels.items())
                lines.append(f"{name}{{{body}}} {_format_value(value)}")
            else:
                lines.append(f"{name} {_format_value(value)}")
    return "\n".join(lines) + "\n"


class MetricsServer:
    """Serves ``render(collect())`` at GET /metrics until stop(); binds and starts in the constructor.
    With ``access`` (an AccessList) only a metrics or admin token (``Authorization: Bearer
    <token>``, as Prometheus' scrape configs send it) is answered: 401 without one, 403 for other
    roles. GET /health answers 200 ``ok`` to anyone (a liveness probe carries no token; it tells
    nothing but that the process serves HTTP). ``tls``: an ssl.SSLContext to serve HTTPS with.
    ``max_connections`` and ``timeout``: see the module docstring."""

    def __init__(
        self,
        port: int,
        collect: Callable[[], Iterable[Sample]],
        host: str = "127.0.0.1",
        access=None,
        tls: ssl.SSLContext | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        timeout: float = DEFAULT_TIMEOUT_S,
    ):
        self._tls, self._max_connections, self._timeout = tls, max_connections, timeout
        self._requests = PendingConnections(max_connections, timeout)  # accepted, request not yet read
        self._live: set[int] = set()  # descriptors of every connection a thread serves
        self._lock = threading.Lock()
        self._handler = self._handler_class(collect, access)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=64)
        self._listener.setblocking(False)  # a connection gone before accept() must not block the loop
        self._backoff = AcceptBackoff("metrics port", log)
        self._resume_at = 0.0  # time.monotonic() before which accept() is not tried (after a failure)
        self._wake_read, wake_write = os.pipe()  # stop() writes a byte: the serving thread returns
        self._wake_write: int | None = wake_write
        self._thread = threading.Thread(target=self._serve, name="metrics-http", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        host, port = self._listener.getsockname()[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    @property
    def port(self) -> int:
        return self._listener.getsockname()[1]

    @property
    def scheme(self) -> str:
        return "http" if self._tls is None else "https"

    def connections(self) -> int:
        """Connections being served now."""
        with self._lock:
            return len(self._live)

    def stop(self) -> None:
        """Stop serving and close the socket (idempotent); connections still reading their
        request are shut down."""
        if self._wake_write is not None:
            os.write(self._wake_write, b"x")
            self._thread.join()
            self._listener.close()
            self._requests.expire(everything=True)
            for fd in (self._wake_read, self._wake_write):
                os.close(fd)
            self._wake_write = None

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- the accepting thread -------------------------------------------------------------------
    def _serve(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self._wake_read, selectors.EVENT_READ)
            listening = False
            while True:
                now = time.monotonic()
                if listening != (now >= self._resume_at):  # not during an accept backoff
                    if listening:
                        selector.unregister(self._listener)
                    else:
                        selector.register(self._listener, selectors.EVENT_READ)
                    listening = not listening
                ready = {key.fileobj for key, _ in selector.select(self._sleep(now))}
                if self._wake_read in ready:
                    return
                self._requests.expire()
                if self._listener in ready:
                    self._accept()

    def _sleep(self, now: float) -> float | None:
        """How long the accepting thread may sleep: until the next deadline or the end of an
        accept backoff; None (until woken) when there is neither."""
        due = [t for t in (self._requests.next_deadline(), self._resume_at if self._resume_at > now else None) if t]
        return max(0.0, min(due) - now) if due else None

    def _accept(self) -> None:
        try:
            sock, peer = self._listener.accept()
        except BlockingIOError:
            return  # gone before it was taken
        except OSError as exc:
            self._resume_at = time.monotonic() + self._backoff.failed(exc)
            return
        self._backoff.accepted()
        fd = sock.fileno()
        with self._lock:
            full = len(self._live) >= self._max_connections
            if full and not len(self._requests):  # all being answered: this one waits for none
                sock.close()
                return
            self._requests.enter(fd, make_room=full)  # full: the oldest still sending its request goes
            self._live.add(fd)
        threading.Thread(target=self._connection, args=(sock, fd, peer), name="metrics-conn", daemon=True).start()

    # -- a connection's thread --------------------------------------------------------------------
    def _connection(self, sock: socket.socket, fd: int, peer) -> None:
        """Serve one request on ``sock``; whatever the client does, unlist and close it."""
        conn = sock
        try:
            sock.settimeout(self._timeout)
            if self._tls is not None:  # handshake after the wrap: a failed one leaves the descriptor to us
                conn = self._tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                conn.do_handshake()
            self._handler(conn, peer, self)
        except (OSError, ValueError) as exc:  # ssl.SSLError and timeouts are OSErrors
            log.debug("metrics connection from %s ended: %s", peer, exc)
        finally:
            self._requests.leave(fd)  # before the close: a listed descriptor is still this socket
            with self._lock:
                self._live.discard(fd)
            conn.close()

    def request_read(self, fd: int) -> bool:
        """The request on ``fd`` has been read: whether it came in time (else it was shut down)."""
        return self._requests.leave(fd)

    def _handler_class(self, collect, access) -> type[BaseHTTPRequestHandler]:
        timeout = self._timeout

        class Handler(BaseHTTPRequestHandler):
            def setup(self) -> None:
                self.timeout = timeout
                super().setup()

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                if not self.server.request_read(self.connection.fileno()):
                    self.close_connection = True
                    return  # past its deadline: shut down already
                path = self.path.split("?", 1)[0]
                if path == "/health":
                    self._reply(200, "text/plain; charset=utf-8", b"ok\n")
                    return
                if access is not None and not self._admitted():
                    return
                if path != "/metrics":
                    self._reply(404, "text/plain; charset=utf-8", b"not found: try /metrics or /health\n")
                    return
                try:
                    body = render(collect()).encode()
                except Exception:  # a broken collector must not kill the server
                    log.exception("metrics collection failed")
                    self._reply(500, "text/plain; charset=utf-8", b"metrics collection failed\n")
                    return
                self._reply(200, CONTENT_TYPE, body)

            def _admitted(self) -> bool:
                header = self.headers.get("Authorization") or ""
                token = header[len("Bearer ") :] if header.startswith("Bearer ") else None
                principal = access.bearer(token)
                if principal is None:
                    self._reply(401, "text/plain; charset=utf-8", b"a metrics or admin token is required\n")
                elif principal.role not in SCRAPE_ROLES:
                    self._reply(403, "text/plain; charset=utf-8", b"metrics are for metrics and admin tokens\n")
                return principal is not None and principal.role in SCRAPE_ROLES

            def _reply(self, code: int, content_type: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args) -> None:  # noqa: A002 (silence per-request logs)
                pass

        return Handler
