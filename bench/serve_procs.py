"""The processes ``bench.serve`` starts: a master, a node, the router and ``vllm serve`` engines.

Every one is started from the main thread with ``die_with_parent`` (SIGTERM when the benchmark
dies, however it dies) and in a process group of its own; ``stop`` sends SIGTERM to the group
(vLLM's API server and its engine-core child together), then SIGKILL if it lingers. Output goes
to a log file, whose tail is in the error when a process does not come up.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from bench.common import die_with_parent

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """One started process and its log."""

    def __init__(self, name: str, argv: list[str], log_path: str, env: dict | None = None, stdout=None):
        self.name, self.log_path = name, log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=dict(os.environ if env is None else env, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1"),
            stdout=stdout or self._log,
            stderr=self._log,
            text=True,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )

    def failure(self, what: str) -> RuntimeError:
        self._log.flush()
        with open(self.log_path) as f:
            tail = f.read()[-3000:]
        return RuntimeError(f"{self.name} {what}:\n{tail}")

    def stop(self, timeout: float = 30) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


def kvstore_service(name: str, args: list[str], log_path: str) -> tuple[Proc, dict]:
    """``kvstore ARGS --json``: the process and the JSON line it prints once it serves."""
    proc = Proc(name, [sys.executable, "-m", "kvstore.cli", *args, "--json"], log_path, stdout=subprocess.PIPE)
    line = proc.proc.stdout.readline()
    if not line:
        raise proc.failure("did not start")
    return proc, json.loads(line)


def start_pool(tmp: str, block_tokens: int, dram: str, logs: str) -> tuple[list[Proc], str]:
    """A master (the conductor's ``[cost_model] block_tokens`` = the engines' block size) and one node."""
    os.makedirs(tmp, exist_ok=True)
    config = os.path.join(tmp, "master.toml")
    with open(config, "w") as f:
        f.write(f"[cost_model]\nblock_tokens = {block_tokens}\n")
    master, record = kvstore_service(
        "master",
        ["master", "--port", "0", "--metrics-port", "-1", "--config", config],
        os.path.join(logs, "master.log"),
    )
    procs = [master]
    try:
        address = record["master"]
        node, _ = kvstore_service(
            "node",
            [
                "node",
                "--master",
                address,
                "--port",
                "0",
                "--metrics-port",
                "-1",
                "--data-dir",
                os.path.join(tmp, "node"),
                "--dram",
                dram,
                "--ssd",
                "0",
            ],
            os.path.join(logs, "node.log"),
        )
        procs.append(node)
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs, address


def start_router(master: str, logs: str) -> tuple[Proc, str]:
    proc, record = kvstore_service(
        "router",
        ["router", "--master", master, "--port", "0", "--read-timeout", "120"],
        os.path.join(logs, "router.log"),
    )
    return proc, record["router"]


class Engine(Proc):
    """``vllm serve`` (vLLM's OpenAI server) on a free port, vLLM's prefix cache on. ``pool``:
    (master, kv_role, role) attaches kvstore's connector with a conductor role; None: a plain engine.
    ``cpus``: ``VLLM_CPU_OMP_THREADS_BIND`` (the cores its OpenMP threads are bound to)."""

    def __init__(
        self,
        name: str,
        model: str,
        logs: str,
        *,
        block_size: int,
        max_model_len: int,
        kv_cache_bytes: int,
        pool: tuple[str, str, str] | None = None,
        cpus: str | None = None,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = name
        kv_transfer_config = None if pool is None else self.connector(*pool)
        argv = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--served-model-name",
            "tiny",
            "--dtype",
            "float32",
            "--block-size",
            str(block_size),
            "--enforce-eager",
            "--port",
            str(self.port),
            "--host",
            "127.0.0.1",
            "--max-model-len",
            str(max_model_len),
            "--kv-cache-memory-bytes",
            str(kv_cache_bytes),
            "--enable-prompt-tokens-details",
            "--enable-prefix-caching",
        ]
        if kv_transfer_config is not None:
            argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        env = dict(os.environ)
        if cpus is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpus
        super().__init__(name, argv, os.path.join(logs, name + ".log"), env=env)

    def connector(self, master: str, kv_role: str, role: str) -> dict:
        return {
            "kv_connector": "KVStoreConnector",
            "kv_connector_module_path": "kvstore_client.vllm",
            "kv_role": kv_role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "master": master,
                "role": role,
                "engine_url": self.url,
                "engine_id": self.name,
                "load_report_interval": 0.2,
            },
        }


def wait_ready(procs: list[Proc], url_of, timeout: float = 600) -> None:
    """Until every process answers 200 at ``url_of(proc)``; a RuntimeError with its log if one exits or times out."""
    pending = list(procs)
    deadline = time.monotonic() + timeout
    while pending:
        for p in list(pending):
            if p.proc.poll() is not None:
                raise p.failure(f"exited with {p.proc.returncode}")
            try:
                with urllib.request.urlopen(url_of(p), timeout=2) as resp:
                    if resp.status == 200:
                        pending.remove(p)
            except OSError:
                pass
        if time.monotonic() > deadline:
            raise pending[0].failure(f"not ready within {timeout:.0f} s")
        time.sleep(0.5)
