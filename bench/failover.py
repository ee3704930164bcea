"""Master failover on etcd: from kill -9 of the leader to the first successful put, and to a complete index.

    python -m bench.failover [--runs 5] [--lease-ttl 2] [--blocks 64] [--json]

Each run starts a fresh single-member etcd (bench.etcd_process), two masters
with ``--etcd`` (the first one leads), one storage node and a writing client,
all named by ``etcd://``; puts ``--blocks`` blocks of 64 KiB; waits until the
index holds them; then SIGKILLs the leader and measures

* ``put_s``: kill to the first put that succeeds again (to a namespace the
  client holds no placement for, so the put needs the master: the standby,
  once etcd let the dead leader's lease go and the node re-registered; puts
  under a placement taken before the kill go on meanwhile, straight to nodes);
* ``index_s``: kill to the moment every block written before the kill is
  locatable again through the new leader (the node's resent inventory);

and checks every byte read back (``wrong_bytes`` must be 0). Figures are
p50 and p99 over the runs (with few runs p99 is the worst run). Both times are
governed by the lease TTL: etcd deletes the key when the lease lapses, TTL after
the dead leader's last keep-alive (sent every TTL/3), so between 2/3 TTL and TTL
after the kill, plus the standby's next poll (100 ms) and the node's re-registration.
``run_cluster`` and ``Kvstore`` are reused by tests/test_failover.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import wait_until
from bench.etcd_process import EtcdProcess

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 64 << 10


class Kvstore:
    """A ``kvstore`` subprocess that printed one JSON line saying where it listens."""

    def __init__(self, args: list[str], log_path: Path):
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore.cli", *args, "--json"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"kvstore {' '.join(args)} did not start; see {log_path}")
        self.record = json.loads(line)

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self._log.close()


def leader_of(etcd_endpoint: str, prefix: str = "/kvstore") -> str | None:
    from kvstore_client.etcd import Etcd, EtcdUnavailable
    from kvstore_client.leader_record import address_of

    etcd = Etcd([etcd_endpoint], timeout=0.5)
    try:
        held = etcd.get(prefix.encode() + b"/leader")
        return address_of(held.value) if held is not None else None
    except EtcdUnavailable:
        return None
    finally:
        etcd.close()


@contextlib.contextmanager
def run_cluster(root: Path, lease_ttl: int = 2, node_ttl: float = 2.0):
    """etcd, two masters (the first leads), one node: yields (etcd, [masters], node, "etcd://...")."""
    root = Path(root)
    started: list[Kvstore] = []
    with EtcdProcess(root) as etcd:
        try:

            def master(i: int) -> Kvstore:
                m = Kvstore(
                    [
                        "master",
                        "--port",
                        "0",
                        "--metrics-port",
                        "-1",
                        "--ttl",
                        str(node_ttl),
                        "--etcd",
                        etcd.endpoint,
                        "--etcd-lease-ttl",
                        str(lease_ttl),
                    ],
                    root / f"master{i}.log",
                )
                started.append(m)
                return m

            first = master(1)
            wait_until(lambda: leader_of(etcd.endpoint) == first.record["master"], 15)
            second = master(2)
            address = f"etcd://{etcd.endpoint}"
            node = Kvstore(
                [
                    "node",
                    "--master",
                    address,
                    "--port",
                    "0",
                    "--metrics-port",
                    "-1",
                    "--data-dir",
                    str(root / "node"),
                    "--dram",
                    "64MiB",
                    "--ssd",
                    "0",
                ],
                root / "node.log",
            )
            started.append(node)
            yield etcd, [first, second], node, address
        finally:
            for proc in reversed(started):
                proc.close()


def write_blocks(client, count: int, tag: bytes) -> dict:
    blocks = {("bench", tag + i.to_bytes(4, "big") + bytes(12)): os.urandom(BLOCK) for i in range(count)}
    for key, value in blocks.items():
        client.put(key, value)
    client.wait_for_puts()
    return blocks


def indexed(checker, keys) -> bool:
    from kvstore_client.errors import KVStoreError

    try:
        return all(checker.batch_exists(list(keys)))
    except KVStoreError:
        return False


def wrong_bytes(client, blocks: dict) -> tuple[int, int]:
    """(bytes that differ, blocks missing) reading every block back."""
    wrong = missing = 0
    for key, value in blocks.items():
        got = client.get(key)
        if got is None:
            missing += 1
        elif got != value:
            wrong += sum(a != b for a, b in zip(got, value)) + abs(len(got) - len(value))
    return wrong, missing


def first_put(client, key, value, timeout: float) -> float:
    """Retry one put until it succeeds; the monotonic time it did."""
    from kvstore_client.errors import KVStoreError

    deadline = time.monotonic() + timeout
    while True:
        try:
            client.put(key, value)
            return time.monotonic()
        except KVStoreError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def one_run(root: Path, lease_ttl: int, count: int) -> dict:
    from kvstore_client import Client

    with run_cluster(root, lease_ttl) as (etcd, masters, node, address):
        with Client(address, timeout=10) as client, Client(address, timeout=10) as checker:
            blocks = write_blocks(client, count, b"pre")
            wait_until(lambda: indexed(checker, blocks), 15)
            leader = next(m for m in masters if m.record["master"] == leader_of(etcd.endpoint))
            killed = time.monotonic()
            leader.signal(signal.SIGKILL)
            leader.proc.wait()
            # a namespace this client has no placement for: the put must ask the (new) master where to go
            key, value = ("after-kill", b"post" + bytes(12)), os.urandom(BLOCK)
            put_at = first_put(client, key, value, 30)
            wait_until(lambda: indexed(checker, blocks), 30, interval=0.005)
            index_at = time.monotonic()
            blocks[key] = value
            client.wait_for_puts()
            wrong, missing = wrong_bytes(checker, blocks)
            survivor = next(m for m in masters if m is not leader)
            return {
                "put_s": put_at - killed,
                "index_s": index_at - killed,
                "wrong_bytes": wrong,
                "missing_blocks": missing,
                "new_leader": leader_of(etcd.endpoint) == survivor.record["master"],
            }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--lease-ttl", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    runs = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="kvstore-failover-") as tmp:
            runs.append(one_run(Path(tmp), args.lease_ttl, args.blocks))
        if not args.json:
            print(
                f"run {i + 1}: put {runs[-1]['put_s']:.2f} s, index {runs[-1]['index_s']:.2f} s, "
                f"wrong bytes {runs[-1]['wrong_bytes']}",
                file=sys.stderr,
            )
    summary = {
        "runs": args.runs,
        "lease_ttl_s": args.lease_ttl,
        "blocks": args.blocks,
        **{f"{name}_p50": statistics.median(r[name] for r in runs) for name in ("put_s", "index_s")},
        **{f"{name}_p99": percentile([r[name] for r in runs], 0.99) for name in ("put_s", "index_s")},
        "wrong_bytes": sum(r["wrong_bytes"] for r in runs),
        "missing_blocks": sum(r["missing_blocks"] for r in runs),
        "all_taken_over": all(r["new_leader"] for r in runs),
    }
    if args.json:
        print(json.dumps({"summary": summary, "runs": runs}))
    else:
        print(
            f"failover (lease TTL {args.lease_ttl} s, {args.runs} runs): first put p50 {summary['put_s_p50']:.2f} s "
            f"p99 {summary['put_s_p99']:.2f} s; complete index p50 {summary['index_s_p50']:.2f} s "
            f"p99 {summary['index_s_p99']:.2f} s; wrong bytes {summary['wrong_bytes']}"
        )


if __name__ == "__main__":
    main()
