"""A small Prometheus exporter: GET /metrics in text format 0.0.4.

    server = MetricsServer(0, collect)        # port 0: any free port
    server.address                            # "127.0.0.1:54321"
    server.stop()

``collect()`` returns samples ``(name, help, type, labels, value)``, where type
is "gauge", "counter" or "untyped" and labels a dict (may be empty). It is
called once per scrape, on the HTTP server's thread, so it must be
thread-safe; samples sharing a name are grouped under one HELP/TYPE header
(the first sample's help and type). A collect() that raises answers 500.
The server runs on a daemon thread (one thread per request), so a process
never waits for it at exit. Used by the master and the storage node.
Between requests that thread sleeps in ``select`` until a client connects
or ``stop()`` writes to a pipe: an idle exporter does not wake up, and stops
at once.
"""

from __future__ import annotations

import logging
import math
import os
import selectors
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterable, Mapping

log = logging.getLogger(__name__)

Sample = tuple[str, str, str, Mapping[str, str], float]
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TYPES = ("counter", "gauge", "untyped", "summary", "histogram")
_ACCEPT_TIMEOUT_S = 1.0  # longest handle_request() waits should a ready connection be gone before accept


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
    With ``access`` (an AccessList) only an admin token (``Authorization: Bearer <token>``, as
    Prometheus' scrape configs send it) is answered: 401 without one, 403 for other roles.
    GET /health answers 200 ``ok`` to anyone (a liveness probe carries no token; it tells
    nothing but that the process serves HTTP)."""

    def __init__(self, port: int, collect: Callable[[], Iterable[Sample]], host: str = "127.0.0.1", access=None):
        self._collect = collect
        self._access = access
        self._httpd = ThreadingHTTPServer((host, port), self._handler_class())
        self._httpd.daemon_threads = True
        self._httpd.timeout = _ACCEPT_TIMEOUT_S
        self._wake_read, wake_write = os.pipe()  # stop() writes a byte: the serving thread returns
        self._wake_write: int | None = wake_write
        self._thread = threading.Thread(target=self._serve, name="metrics-http", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self._httpd.socket, selectors.EVENT_READ)
            selector.register(self._wake_read, selectors.EVENT_READ)
            while True:
                ready = {key.fileobj for key, _ in selector.select()}
                if self._wake_read in ready:
                    return
                self._httpd.handle_request()  # accepts the connection; its own thread serves it

    @property
    def address(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"{host}:{port}"

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    def stop(self) -> None:
        """Stop serving and close the socket (idempotent)."""
        if self._wake_write is not None:
            os.write(self._wake_write, b"x")
            self._thread.join()
            self._httpd.server_close()
            for fd in (self._wake_read, self._wake_write):
                os.close(fd)
            self._wake_write = None

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        collect, access = self._collect, self._access

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                if self.path.split("?", 1)[0] == "/health":
                    self._reply(200, "text/plain; charset=utf-8", b"ok\n")
                    return
                if access is not None and not self._admitted():
                    return
                if self.path.split("?", 1)[0] != "/metrics":
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
                    self._reply(401, "text/plain; charset=utf-8", b"an admin token is required\n")
                elif principal.role != "admin":
                    self._reply(403, "text/plain; charset=utf-8", b"metrics are for admin tokens\n")
                return principal is not None and principal.role == "admin"

            def _reply(self, code: int, content_type: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args) -> None:  # noqa: A002 (silence per-request logs)
                pass

        return Handler
