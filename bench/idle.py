"""What an idle pool costs: wake-ups and CPU per second of a master and a node that serve nothing.

    python -m bench.idle --seconds 10 --runs 3 --json

Starts a master and one node (metrics exporters on, as operators run them), lets them settle,
then reads every thread's scheduler counters (``/proc/PID/task/TID/schedstat``, Linux) before
and after ``--seconds`` of nothing: how many times a thread was put on a CPU (a wake-up) and
the CPU time it used. The baseline, measured in the same run, is a bare grpcio server with
the same thread pool size and no services, idle too: what gRPC costs before kvstore adds
anything. Medians over ``--runs``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.cluster import start_master, start_node
from bench.common import die_with_parent, emit, markdown_table

BARE_GRPC_SERVER = """
import concurrent.futures, sys, grpc
server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=8))
server.add_insecure_port("127.0.0.1:0")
server.start()
print("ready", flush=True)
sys.stdin.read()
"""


def scheduler_counters(pid: int) -> tuple[int, float]:
    """(times any thread of ``pid`` was put on a CPU, CPU seconds they used) so far."""
    runs, cpu_ns = 0, 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                on_cpu, _, slices = map(int, f.read().split())
        except (OSError, ValueError):  # the thread ended meanwhile
            continue
        runs, cpu_ns = runs + slices, cpu_ns + on_cpu
    return runs, cpu_ns / 1e9


def idle_rates(pids: dict[str, int], seconds: float) -> dict[str, dict]:
    """Wake-ups per second and CPU milliseconds per second of each process over ``seconds``."""
    before = {name: scheduler_counters(pid) for name, pid in pids.items()}
    time.sleep(seconds)
    after = {name: scheduler_counters(pid) for name, pid in pids.items()}
    return {
        name: {
            "wakeups_per_s": (after[name][0] - before[name][0]) / seconds,
            "cpu_ms_per_s": (after[name][1] - before[name][1]) * 1000 / seconds,
        }
        for name in pids
    }


def one_run(workdir: Path, seconds: float, settle: float) -> dict[str, dict]:
    master = start_master(workdir, metrics=True)
    node = baseline = None
    try:
        node = start_node(master.record["master"], workdir, "node", "64MiB", "64MiB", "16MiB", metrics=True)
        baseline = subprocess.Popen(
            [sys.executable, "-c", BARE_GRPC_SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=die_with_parent,
        )
        baseline.stdout.readline()
        time.sleep(settle)  # past registration and the first heartbeats
        return idle_rates({"master": master.pid, "node": node.pid, "bare_grpc_server": baseline.pid}, seconds)
    finally:
        if baseline is not None:
            baseline.stdin.close()
            baseline.wait(10)
        for service in (node, master):
            if service is not None:
                service.close()


def summarize(runs: list[dict[str, dict]]) -> dict[str, dict]:
    return {name: {key: statistics.median(run[name][key] for run in runs) for key in runs[0][name]} for name in runs[0]}


def table(result: dict) -> str:
    rows = [
        [name, f"{figures['wakeups_per_s']:.0f}", f"{figures['cpu_ms_per_s']:.2f}"]
        for name, figures in result["median"].items()
    ]
    return markdown_table(["process", "wake-ups/s", "CPU ms/s"], rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="idle seconds measured a run")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds after start before measuring")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    runs = []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as workdir:
            runs.append(one_run(Path(workdir), args.seconds, args.settle))
    emit({"seconds": args.seconds, "runs": runs, "median": summarize(runs)}, args.json, table)


if __name__ == "__main__":
    main()
