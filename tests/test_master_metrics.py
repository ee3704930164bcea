"""The reusable Prometheus exporter (kvstore.metrics) and the master's run_master entry point.

The exporter on 127.0.0.1 ports chosen at run time, real sockets and, for accept failures,
a process of its own out of descriptors."""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest

from kvstore.metrics import MetricsServer, render
from kvstore_client.proto import kvstore_pb2 as pb
from kvstore_client.proto import kvstore_pb2_grpc as pb_grpc


def test_render_groups_by_name_and_escapes():
    text = render(
        [
            ("x_total", "Things\ncounted.", "counter", {"k": 'a"b\\c\nd'}, 3),
            ("y", "A gauge.", "gauge", {}, 1.5),
            ("x_total", "ignored", "counter", {"k": "e"}, 4),
            ("z", "Odd type.", "weird", {}, float("inf")),
        ]
    )
    assert text == (
        "# HELP x_total Things\\ncounted.\n# TYPE x_total counter\n"
        'x_total{k="a\\"b\\\\c\\nd"} 3\nx_total{k="e"} 4\n'
        "# HELP y A gauge.\n# TYPE y gauge\ny 1.5\n"
        "# HELP z Odd type.\n# TYPE z untyped\nz +Inf\n"
    )


def test_metrics_server_serves_and_reports_collector_failures():
    calls = []

    def collect():
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("boom")
        return [("up", "Up.", "gauge", {}, 1)]

    with MetricsServer(0, collect) as server:
        url = f"http://{server.address}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            assert resp.status == 200 and resp.read() == b"# HELP up Up.\n# TYPE up gauge\nup 1\n"
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url, timeout=5)
        assert err.value.code == 500
    server.stop()  # idempotent


def test_run_master_serves_until_sigterm():
    code = (
        "import logging; from kvstore.master.server import run_master; "
        "run_master('127.0.0.1', 0, on_ready=lambda s: print(s.address, flush=True))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    try:
        address = proc.stdout.readline().strip()
        with grpc.insecure_channel(address) as channel:
            reply = pb_grpc.MasterStub(channel).Register(pb.RegisterRequest(info=pb.NodeInfo(node_id="n")), timeout=5)
            assert reply.ttl_s > reply.heartbeat_interval_s > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- what one connection may hold, roles, TLS, accept failures (the metrics port) -----------------------
# Whoever reaches the port can connect: connections and threads are capped, each request has a
# deadline however it trickles, only metrics and admin tokens scrape, HTTPS under TLS, and an
# accept() out of descriptors backs off instead of spinning.
UP = [("up", "Up.", "gauge", {}, 1)]
CAP, TIMEOUT = 4, 1.0
GENEROUS = 20.0  # seconds: liveness only


def get(url: str, token: str | None = None, context=None) -> tuple[int, bytes]:
    """(status, body) of a GET; HTTP errors are statuses too."""
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=GENEROUS, context=context) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` without a byte of answer (EOF, or a reset when it
    closed on a request it had not read)."""
    sock.settimeout(GENEROUS)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_idle_and_trickling_connections_hold_no_more_than_the_cap_and_are_closed():
    from tests.processes import wait_for
    from tests.test_preauth_limits import Tricklers

    before = threading.active_count()
    with MetricsServer(0, lambda: UP, max_connections=CAP, timeout=TIMEOUT) as server:
        host, port = server.address.rsplit(":", 1)
        idle = [socket.create_connection((host, int(port)), timeout=GENEROUS) for _ in range(30)]
        tricklers = Tricklers(server.address, CAP, b"GET /metrics HTTP/1.0\r\nX-Slow: " + b"s" * 4096)
        try:
            time.sleep(0.2)  # the accepting thread has taken them all
            # its own, the tricklers', one a connection (and a couple dropped, on their way out): not 30
            assert threading.active_count() <= before + 2 + CAP + 2
            assert get(f"http://{server.address}/metrics")[0] == 200  # a scrape still answers
            wait_for(tricklers.all_closed, timeout=GENEROUS)  # the deadline, not a per-recv timeout
            for sock in idle:
                assert closed_by_server(sock)  # over the cap, or at the deadline
            wait_for(lambda: server.connections() == 0, timeout=GENEROUS)
        finally:
            tricklers.close()
            for sock in idle:
                sock.close()


def test_when_every_connection_is_being_answered_one_more_is_closed_at_once():
    entered, release = threading.Semaphore(0), threading.Event()

    def slow_collect():
        entered.release()
        release.wait(GENEROUS)
        return UP

    with MetricsServer(0, slow_collect, max_connections=CAP, timeout=GENEROUS) as server:
        url = f"http://{server.address}/metrics"
        answers: list[int] = []
        scrapes = [threading.Thread(target=lambda: answers.append(get(url)[0])) for _ in range(CAP)]
        for scrape in scrapes:
            scrape.start()
        for _ in range(CAP):
            assert entered.acquire(timeout=GENEROUS)  # all CAP are being answered
        host, port = server.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=GENEROUS) as extra:
            extra.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            assert closed_by_server(extra)  # at once, not queued behind them
        release.set()
        for scrape in scrapes:
            scrape.join(GENEROUS)
        assert answers == [200] * CAP


def test_a_metrics_token_scrapes_and_other_roles_do_not(tmp_path):
    from tests.access_files import ADMIN, NODE, TENANT_A, WRONG
    from tests.test_preauth_limits import METRICS, access_with_metrics

    with MetricsServer(0, lambda: UP, access=access_with_metrics(tmp_path)) as server:
        url = f"http://{server.address}/metrics"
        assert get(url, METRICS) == (200, b"# HELP up Up.\n# TYPE up gauge\nup 1\n")
        assert get(url, ADMIN)[0] == 200
        assert [get(url, token)[0] for token in (TENANT_A, NODE)] == [403, 403]
        assert [get(url, token)[0] for token in (None, WRONG)] == [401, 401]
        assert get(f"http://{server.address}/health") == (200, b"ok\n")  # probes carry no token


def test_under_tls_the_port_speaks_https_only(tmp_path):
    pytest.importorskip("cryptography")
    from bench.pki import issue, make_ca
    from kvstore.security.tls import ServerTLS

    ca = make_ca(tmp_path)
    tls = ServerTLS(*issue(tmp_path, ca, "server", server=True), ca=str(ca[2]))
    with MetricsServer(0, lambda: UP, tls=tls.server_context(), timeout=GENEROUS) as server:
        assert server.scheme == "https"
        trusted = ssl.create_default_context(cafile=str(ca[2]))
        assert get(f"https://{server.address}/metrics", context=trusted)[0] == 200
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # plain text: a token would travel in clear
            get(f"http://{server.address}/metrics")
        with pytest.raises(urllib.error.URLError):  # a certificate this client cannot verify
            get(f"https://{server.address}/metrics", context=ssl.create_default_context())


_OUT_OF_DESCRIPTORS = """
import json, logging, os, resource, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
from kvstore.metrics import MetricsServer
from kvstore.node.config import StoreConfig
from kvstore.node.store import BlockStore
from kvstore.transport.server import DataPlaneServer

store = BlockStore(StoreConfig(dram_capacity=4 << 20, max_block_bytes=1 << 20))
node = DataPlaneServer(store).start()
metrics = MetricsServer(0, lambda: [("up", "Up.", "gauge", {}, 1)])
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
print(json.dumps({"node": node.address, "metrics": metrics.address}), flush=True)
held = []
for line in sys.stdin:
    if line.strip() == "exhaust":
        try:
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
    else:
        for fd in held:
            os.close(fd)
        held = []
    print("done", flush=True)
"""


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_accept_out_of_descriptors_backs_off_and_is_logged_once(tmp_path):
    """A process out of descriptors (RLIMIT_NOFILE): its listeners' accept() fails with EMFILE
    while connections wait. The accepting threads pause instead of spinning (little CPU), say so
    once each with no traceback, and accept the waiting connections once descriptors are free."""
    from kvstore_client.transport import TcpConnection
    from tests.processes import ROOT

    err_path = tmp_path / "stderr"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", _OUT_OF_DESCRIPTORS],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    waiting: list[socket.socket] = []
    try:
        record = json.loads(proc.stdout.readline())
        proc.stdin.write("exhaust\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "done\n"
        for address in (record["node"], record["metrics"]):  # in the listeners' backlogs
            host, port = address.rsplit(":", 1)
            waiting += [socket.create_connection((host, int(port)), timeout=GENEROUS) for _ in range(3)]
        spent = _cpu_seconds(proc.pid)
        time.sleep(2.0)
        assert _cpu_seconds(proc.pid) - spent < 1.0  # a spinning accept loop would burn the whole 2 s
        proc.stdin.write("release\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "done\n"
        with TcpConnection(record["node"], timeout=GENEROUS) as conn:
            conn.ping()
        assert get(f"http://{record['metrics']}/metrics")[0] == 200
    finally:
        for sock in waiting:
            sock.close()
        proc.stdin.close()
        proc.wait(timeout=GENEROUS)
        proc.stdout.close()
    log = err_path.read_text()
    assert "Traceback" not in log, log[-4000:]
    assert log.count("accept failed") == 2, log[-4000:]  # once per listener: the node's and the metrics port's
    assert log.count("accepting again") == 2, log[-4000:]
