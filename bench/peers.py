"""The peers ``bench.vllm_reuse`` runs beside kvstore, or the reason each cannot run here.

LMCache: lmcache 0.5.6's ``LMCacheMPConnector`` against an ``lmcache server`` process (its
in-engine ``LMCacheConnectorV1`` has no path for vLLM's CPU backend: it finds "no
supported cpu connector" and recomputes). It runs from an environment of its own, built
by ``scripts/lmcache-venv`` (``./.venv-lmcache``; or name another one's python in
``KVSTORE_LMCACHE_PYTHON``), because lmcache pins protobuf 6, which kvstore's generated
stubs refuse. The server hashes tokens in chunks of ``--chunk-size``; it is set to vLLM's
block size so that LMCache can hit on the same block boundaries kvstore does.

vLLM's own offloading connectors keep KV in the engine's own host memory, so a fresh
engine in another process can never hit them; on vLLM 0.32's CPU backend neither starts
at all (see ``OFFLOADING_SKIPS``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from dataclasses import dataclass, field

from bench.common import die_with_parent

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OFFLOADING_SKIPS = [
    "vLLM OffloadingConnector: does not start on vLLM's CPU backend "
    '("CPU Offloading is currently only supported on CUDA-alike and XPU GPUs")',
    "vLLM SimpleCPUOffloadConnector: does not start on vLLM's CPU backend (it needs CUDA streams)",
]
# LMCache reports usage to its authors unless told not to; nothing may leave this machine.
QUIET = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}


def lmcache_python() -> str | None:
    """The python of the LMCache environment, or None when there is none."""
    python = os.environ.get("KVSTORE_LMCACHE_PYTHON") or os.path.join(ROOT, ".venv-lmcache", "bin", "python")
    return python if os.path.exists(python) else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LMCachePeer:
    """A running ``lmcache server`` and what an engine needs to use it."""

    python: str
    process: subprocess.Popen
    kv_transfer_config: dict
    engine_env: dict = field(default_factory=dict)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_lmcache(
    log_path: str, *, block_size: int, size_gb: float = 4.0, start_timeout: float = 120
) -> LMCachePeer | str:
    """Start an ``lmcache server`` on free loopback ports; the peer, or why it cannot run."""
    python = lmcache_python()
    if python is None:
        return "no LMCache environment (build one with scripts/lmcache-venv, or set KVSTORE_LMCACHE_PYTHON)"
    port, http_port = free_port(), free_port()
    env = dict(os.environ, **QUIET)
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [
                python,
                "-c",
                "import sys; from lmcache.cli.main import main; sys.argv[0] = 'lmcache'; sys.exit(main())",
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--http-host",
                "127.0.0.1",
                "--http-port",
                str(http_port),
                "--chunk-size",
                str(block_size),
                "--l1-size-gb",
                str(size_gb),
                "--eviction-policy",
                "LRU",
                "--supported-transfer-mode",
                "auto",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
            preexec_fn=die_with_parent,
        )
    deadline = time.monotonic() + start_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return f"lmcache server exited with {process.returncode} (log: {log_path})"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.5)
    else:
        process.kill()
        return f"lmcache server did not listen within {start_timeout:.0f} s (log: {log_path})"
    config = {
        "kv_connector": "LMCacheMPConnector",
        "kv_connector_module_path": "bench.lmcache_shim",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port},
    }
    return LMCachePeer(python, process, config, dict(QUIET))


def offloading_skip_notes() -> list[str]:
    return list(OFFLOADING_SKIPS)
