"""A throwaway single-member etcd on loopback, for tests/test_failover.py and bench.failover.

    with EtcdProcess(tmp_path) as etcd:
        etcd.endpoint          # "127.0.0.1:41235"
        etcd.restart()         # stop and start again on the same ports and data dir

With ``tls=EtcdServerTLS(cert, key, trusted_ca)`` the client port speaks TLS
only (``https://``; etcd's --cert-file/--key-file, and with ``trusted_ca``
--trusted-ca-file and --client-cert-auth); ``client_tls`` (an EtcdTLS) is
what the readiness check dials with. ``etcd.url`` is the client URL.

Ports are chosen at run time; the data dir is ``root/etcd``. ``etcd_binary()``
is None when no ``etcd`` is on PATH (Debian: apt-get install etcd-server).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EtcdServerTLS:
    """etcd's certificate and key; ``trusted_ca``: require client certificates signed by it."""

    cert: str
    key: str
    trusted_ca: str | None = None

    def flags(self) -> list[str]:
        flags = ["--cert-file", str(self.cert), "--key-file", str(self.key)]
        if self.trusted_ca is not None:
            flags += ["--trusted-ca-file", str(self.trusted_ca), "--client-cert-auth"]
        return flags


def etcd_binary() -> str | None:
    return shutil.which("etcd")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EtcdProcess:
    """One etcd member (see the module docstring)."""

    def __init__(self, root: Path, tls: EtcdServerTLS | None = None, client_tls=None):
        self.tls, self.client_tls = tls, client_tls
        binary = etcd_binary()
        if binary is None:
            raise FileNotFoundError("etcd is not installed (apt-get install etcd-server)")
        self.binary, self.data_dir = binary, Path(root) / "etcd"
        self.client_port, self.peer_port = free_port(), free_port()
        self.endpoint = f"127.0.0.1:{self.client_port}"
        self.log_path = Path(root) / "etcd.log"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self, timeout: float = 15.0) -> None:
        client, peer = self.url, f"http://127.0.0.1:{self.peer_port}"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    "--name",
                    "kvstore-test",
                    "--data-dir",
                    str(self.data_dir),
                    "--listen-client-urls",
                    client,
                    "--advertise-client-urls",
                    client,
                    "--listen-peer-urls",
                    peer,
                    "--initial-advertise-peer-urls",
                    peer,
                    "--initial-cluster",
                    f"kvstore-test={peer}",
                    "--heartbeat-interval",
                    "50",
                    "--election-timeout",
                    "500",
                    *(self.tls.flags() if self.tls else []),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        from kvstore_client.etcd import Etcd, EtcdUnavailable

        etcd = Etcd([self.endpoint], timeout=0.5, tls=self.client_tls)
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    etcd.get(b"/ready")
                    return
                except EtcdUnavailable:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"etcd did not start; see {self.log_path}") from None
                    time.sleep(0.05)
        finally:
            etcd.close()

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client_port}"

    def stop(self, kill: bool = False) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill() if kill else self.proc.terminate()
            self.proc.wait(timeout=15)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> EtcdProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop(kill=True)
