"""Real kvstore processes for bench.fuzz and bench.soak, and what /proc says about them.

``Service`` runs ``python -m kvstore.cli master|node ... --json`` with its stderr in a
file (scanned for tracebacks afterwards) and dies with the benchmark (die_with_parent).
``proc_sample(pid)`` reads one process's memory split, open fds and threads from
/proc/PID/status and /proc/PID/fd (Linux).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from bench.common import die_with_parent

ROOT = Path(__file__).resolve().parent.parent
KiB = 1024

# An access file for the nodes that check tokens: written mode 0600 (kvstore refuses others).
ADMIN_TOKEN = "bench-admin-token-0123456789abcdef"
NODE_TOKEN = "bench-node-token-0123456789abcdef"
ACCESS_TOML = f"""
[tokens.root]
secret = "{ADMIN_TOKEN}"
role = "admin"

[tokens.storage]
secret = "{NODE_TOKEN}"
role = "node"
"""


def write_access_file(directory: Path) -> Path:
    path = Path(directory) / "access.toml"
    path.write_text(ACCESS_TOML)
    os.chmod(path, 0o600)
    return path


class Service:
    """One ``kvstore`` process; ``record`` is the JSON line it printed once serving."""

    def __init__(self, args: list[str], err_path: Path):
        self.err_path = Path(err_path)
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvstore.cli", *args, "--json"],
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                preexec_fn=die_with_parent,
            )
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(10)
            raise RuntimeError(f"kvstore {' '.join(args)} did not start:\n{self.stderr()[-4000:]}")
        self.record = json.loads(line)
        self.pid = self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def tracebacks(self) -> int:
        return self.stderr().count("Traceback")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()


def _metrics_port(metrics: bool) -> str:
    return "0" if metrics else "-1"  # 0: any free port; -1: no exporter


def start_master(workdir: Path, extra: tuple = (), metrics: bool = False) -> Service:
    return Service(
        ["master", "--port", "0", "--metrics-port", _metrics_port(metrics), "--ttl", "30", *extra],
        Path(workdir) / "master.err",
    )


def start_node(
    master: str,
    workdir: Path,
    name: str,
    dram: str,
    ssd: str,
    max_block: str,
    extra: tuple = (),
    metrics: bool = False,
) -> Service:
    data = Path(workdir) / name
    data.mkdir(parents=True, exist_ok=True)
    return Service(
        [
            "node",
            "--master",
            master,
            "--port",
            "0",
            "--metrics-port",
            _metrics_port(metrics),
            "--data-dir",
            str(data),
            "--dram",
            dram,
            "--ssd",
            ssd,
            "--max-block",
            max_block,
            *extra,
        ],
        Path(workdir) / f"{name}.err",
    )


def reap_arenas() -> None:
    """Remove the shared-memory arenas of nodes that are gone (a killed node leaves its own)."""
    from kvstore.tiers.arena import reap_stale_arenas

    reap_stale_arenas()


_STATUS_FIELDS = {
    "VmRSS": "rss",
    "RssAnon": "rss_anon",
    "RssFile": "rss_file",
    "RssShmem": "rss_shmem",
    "Threads": "threads",
}


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_sample(pid: int) -> dict | None:
    """{rss, rss_anon, rss_file, rss_shmem (bytes), threads, fds, cpu_s (user + system seconds)}
    of a live process; None if it is gone."""
    out: dict = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                field = _STATUS_FIELDS.get(name)
                if field is not None:
                    number = int(value.split()[0])
                    out[field] = number if field == "threads" else number * KiB
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out["cpu_s"] = round((int(fields[11]) + int(fields[12])) / _CLK_TCK, 2)  # utime + stime
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return out


def slope(points: list[tuple[float, float]]) -> float:
    """The least-squares slope of (x, y) points (0 for fewer than two distinct x)."""
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in points) / sxx
