"""Real kvstore processes for tests: a master and storage nodes on 127.0.0.1, ports chosen at run time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class Service:
    """A `kvstore` subprocess that printed one JSON line saying where it listens."""

    def __init__(self, args: list[str], prefix: tuple[str, ...] = ()):
        """``prefix``: what runs the command, e.g. ``ip netns exec NAME`` (bench.netns; it execs
        the command, so ``proc.pid`` is the service's own pid)."""
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        self.args = args
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "kvstore.cli", *args, "--json"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read()
            raise RuntimeError(f"kvstore {' '.join(args)} did not start:\n{err}")
        self.record = json.loads(line)

    def kill(self) -> None:
        """SIGKILL: no cleanup at all, like a crashed host process."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
        self._reap_arena()

    def terminate(self, timeout: float = 30) -> int:
        """SIGTERM and wait: the clean shutdown path."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=timeout)
        return self.proc.returncode

    def _reap_arena(self) -> None:
        from kvstore.tiers.arena import reap_stale_arenas

        reap_stale_arenas()
        sock = self.record.get("unix_socket")
        if sock and os.path.exists(sock):
            os.unlink(sock)

    def close(self) -> None:
        try:
            self.terminate(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()
        self._reap_arena()
        for stream in (self.proc.stdout, self.proc.stderr):
            stream.close()


def start_master(
    port: int = 0, ttl: float = 1.0, replicas: int = 1, extra: tuple[str, ...] = (), prefix: tuple[str, ...] = ()
) -> Service:
    return Service(
        ["master", "--port", str(port), "--metrics-port", "0", "--ttl", str(ttl), "--replicas", str(replicas), *extra],
        prefix,
    )


def start_node(
    master: str,
    data_dir: Path,
    dram: str = "32MiB",
    ssd: str = "64MiB",
    max_block: str = "4MiB",
    extra: tuple[str, ...] = (),
    prefix: tuple[str, ...] = (),
) -> Service:
    return Service(
        [
            "node",
            "--master",
            master,
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--data-dir",
            str(data_dir),
            "--dram",
            dram,
            "--ssd",
            ssd,
            "--max-block",
            max_block,
            *extra,
        ],
        prefix,
    )


def recv_exact(sock, n: int) -> bytes:
    """Exactly ``n`` bytes from a socket; EOFError if it closes first (raw-frame tests)."""
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise EOFError(f"connection closed after {len(out)} of {n} bytes")
        out += chunk
    return bytes(out)


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05):
    """Poll until ``predicate()`` is truthy; return its value or fail the test."""
    from bench.common import wait_until

    try:
        return wait_until(predicate, timeout, interval)
    except TimeoutError:
        raise AssertionError(f"condition not met within {timeout}s") from None
