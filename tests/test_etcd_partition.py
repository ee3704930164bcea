"""The leader cut off from etcd, and only from etcd: it stops serving, a standby takes over.

Hosts (bench.netns): E runs etcd, M1 the first master (the leader), M2 the second (a
standby), N a storage node, C a verifying client; every process is real and every one
names the cluster ``etcd://E:2379``. Then M1 alone loses its route to E (a ``prohibit``
route inside M1: nodes and clients still reach M1, M1 no longer reaches etcd).

Checked: within the lease TTL M1 refuses every call (UNAVAILABLE, "this master is a
standby", never naming itself the leader), and never serves again, not even once the
partition heals; M2 takes over, the node registers with it and its index holds every
block written before the cut; the client goes on through etcd:// with no wrong byte;
once healed, M1 stands by naming M2 and does not take the leadership back. M1's stderr
says it lost the leadership, and no process logged a traceback.

Skipped without root and ``ip`` (bench.netns.unavailable) or without an ``etcd`` binary.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.common import die_with_parent
from bench.etcd_process import etcd_binary
from bench.netns import Network, NetnsUnavailable, unavailable
from tests.processes import wait_for

ROOT = Path(__file__).resolve().parent.parent
LEASE_TTL = 2  # the masters' etcd lease (s)
NODE_TTL = 2.0  # the master's node lease (s)
ETCD_PORT, MASTER_PORT = 2379, 7700  # each host is a namespace of its own: fixed ports do not collide
BLOCK = 64 << 10
BLOCKS = 16

# Runs in C's interpreter; ETCD (host:port) and BLOCK are set first.
AGENT = r'''
import random, threading, time
import grpc
from kvstore_client import Client, make_key
from kvstore_client.etcd import Etcd, EtcdUnavailable
from kvstore_client.proto import kvstore_pb2 as pb
from kvstore_client.proto import kvstore_pb2_grpc as pb_grpc

etcd = Etcd([ETCD], timeout=0.5)
clients, channels = {}, {}

def client(address):
    """One Client per address (etcd://... follows the leader; host:port is that master alone)."""
    if address not in clients:
        clients[address] = Client(address, timeout=20)
    return clients[address]

def etcd_leader():
    try:
        held = etcd.get(b"/kvstore/leader")
    except EtcdUnavailable:
        return None
    return held.value.decode() if held is not None else None

def etcd_ready():
    try:
        etcd.get(b"/ready")
        return True
    except EtcdUnavailable:
        return False

def keys(ns, n):
    return [make_key(ns, b"block-%d" % i) for i in range(n)]

def value(key):
    """A block's bytes, derived from its key alone: any mix-up reads as wrong bytes."""
    return random.Random(repr(key)).randbytes(BLOCK)

def put(ns, n):
    c = client("etcd://" + ETCD)
    for key in keys(ns, n):
        c.put(key, value(key))
    c.wait_for_puts()

def wrong(ns, n):
    """(bytes that differ, blocks missing) reading ns back through etcd://."""
    got = client("etcd://" + ETCD).batch_get(keys(ns, n))
    missing = sum(v is None for v in got)
    bad = sum(sum(a != b for a, b in zip(v, value(k))) + abs(len(v) - BLOCK)
              for k, v in zip(keys(ns, n), got) if v is not None)
    return [bad, missing]

def holders(address, ns, n):
    """Per block of ns, the node ids the index of the master at ``address`` lists (that master only)."""
    index = {key[1]: i for i, key in enumerate(keys(ns, n))}
    out = [[] for _ in range(n)]
    for entry in client(address).list_keys(ns, limit=10 * n).keys:
        out[index[entry.digest]] = sorted(r.node_id for r in entry.replicas)
    return out

def alive_nodes(address):
    return sorted(n.info.node_id for n in client(address).cluster_status().nodes if n.alive)

def probe(address):
    """A mutating RPC (Deregister of a node nobody runs) straight to one master:
    [sent, answered, served, "CODE: details", the leader its trailing metadata names]."""
    if address not in channels:
        channels[address] = grpc.insecure_channel(address)
    stub = pb_grpc.MasterStub(channels[address])
    sent = time.time()
    try:
        stub.Deregister(pb.DeregisterRequest(node_id="fence-probe"), timeout=3)
        return [sent, time.time(), True, "OK", ""]
    except grpc.RpcError as exc:
        leader = dict(exc.trailing_metadata() or ()).get("kvstore-leader", "")
        return [sent, time.time(), False, f"{exc.code().name}: {exc.details()}", leader]

watch = {"stop": threading.Event(), "probes": [], "leaders": [], "threads": []}

def _probe_loop(address):
    while not watch["stop"].is_set():
        watch["probes"].append(probe(address))
        watch["stop"].wait(0.05)

def _leader_loop():
    """Each change of etcd's leader key as read from here (reads that failed are left out)."""
    while not watch["stop"].wait(0.05):
        now = time.time()
        try:
            held = etcd.get(b"/kvstore/leader")
        except EtcdUnavailable:
            continue
        seen = held.value.decode() if held is not None else None
        if not watch["leaders"] or watch["leaders"][-1][1] != seen:
            watch["leaders"].append([now, seen])

def watch_start(address):
    """Probe ``address`` and read etcd's leader every 50 ms until watch_stop()."""
    watch["threads"] = [threading.Thread(target=_probe_loop, args=(address,), daemon=True),
                        threading.Thread(target=_leader_loop, daemon=True)]
    for thread in watch["threads"]:
        thread.start()

def watch_stop():
    watch["stop"].set()
    for thread in watch["threads"]:
        thread.join(10)
    return {"probes": watch["probes"], "leaders": watch["leaders"]}
'''


class Kvstore:
    """``kvstore ARGS --json`` inside a host, its stderr in a file (read while it runs)."""

    def __init__(self, host, args: list[str], log_path: Path):
        self.log_path = log_path
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                host.command([sys.executable, "-m", "kvstore.cli", *args, "--json"]),
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                preexec_fn=die_with_parent,
            )
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"kvstore {' '.join(args)} did not start:\n{self.stderr()}")
        self.record = json.loads(line)

    def stderr(self) -> str:
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()


def start_etcd(host, root: Path) -> subprocess.Popen:
    client, peer = f"http://{host.address}:{ETCD_PORT}", "http://127.0.0.1:2380"
    with open(root / "etcd.log", "wb") as log:
        return subprocess.Popen(
            host.command(
                [
                    etcd_binary(),
                    "--name",
                    "e",
                    "--data-dir",
                    str(root / "etcd"),
                    "--listen-client-urls",
                    client,
                    "--advertise-client-urls",
                    client,
                    "--listen-peer-urls",
                    peer,
                    "--initial-advertise-peer-urls",
                    peer,
                    "--initial-cluster",
                    f"e={peer}",
                    "--heartbeat-interval",
                    "50",
                    "--election-timeout",
                    "500",
                ]
            ),
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
        )


@pytest.fixture
def cluster(tmp_path):
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    if etcd_binary() is None:
        pytest.skip("no etcd binary on PATH (apt-get install etcd-server; scripts/test does it as root)")
    try:
        net = Network()
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))
    services: list[Kvstore] = []
    etcd = None
    try:
        try:
            e, m1, m2, n, c = (net.add_host(name) for name in ("e", "m1", "m2", "n", "c"))
        except NetnsUnavailable as exc:
            pytest.skip(str(exc))
        agent = c.python()
        etcd_address = f"{e.address}:{ETCD_PORT}"
        agent.exec(f"ETCD = {etcd_address!r}\nBLOCK = {BLOCK}\n" + AGENT, wait=False)  # imports while etcd starts
        etcd = start_etcd(e, tmp_path)
        agent.result(timeout=120)
        wait_for(lambda: etcd.poll() is None and agent.eval("etcd_ready()"), timeout=30)

        def master(host, i):
            return Kvstore(
                host,
                [
                    "master",
                    "--host",
                    host.address,
                    "--port",
                    str(MASTER_PORT),
                    "--metrics-port",
                    "-1",
                    "--ttl",
                    str(NODE_TTL),
                    "--insecure",
                    "--etcd",
                    etcd_address,
                    "--etcd-lease-ttl",
                    str(LEASE_TTL),
                ],
                tmp_path / f"master{i}.log",
            )

        services.append(master(m1, 1))
        leader = services[0].record["master"]
        wait_for(lambda: agent.eval("etcd_leader()") == leader, timeout=30)
        services.append(master(m2, 2))
        services.append(
            Kvstore(
                n,
                [
                    "node",
                    "--master",
                    f"etcd://{etcd_address}",
                    "--host",
                    n.address,
                    "--port",
                    "0",
                    "--metrics-port",
                    "-1",
                    "--insecure",
                    "--data-dir",
                    str(tmp_path / "node"),
                    "--dram",
                    "64MiB",
                    "--ssd",
                    "0",
                ],
                tmp_path / "node.log",
            )
        )
        yield {
            "hosts": {"e": e, "m1": m1, "m2": m2, "n": n, "c": c},
            "agent": agent,
            "m1": services[0],
            "m2": services[1],
            "node": services[2],
        }
    finally:
        for service in reversed(services):
            service.close()
        if etcd is not None and etcd.poll() is None:
            etcd.kill()
            etcd.wait()
        net.close()
        from kvstore.tiers.arena import reap_stale_arenas

        reap_stale_arenas()


def test_leader_cut_off_from_etcd_stops_serving_and_the_standby_takes_over(cluster):
    hosts, agent = cluster["hosts"], cluster["agent"]
    m1, m2 = cluster["m1"].record["master"], cluster["m2"].record["master"]
    node_id = cluster["node"].record["node_id"]

    def run(code: str, timeout: float = 60):
        return agent.eval(code, timeout=timeout)

    wait_for(lambda: run(f"alive_nodes({m1!r})") == [node_id], timeout=30)
    run(f"put('before', {BLOCKS})")
    wait_for(lambda: run(f"holders({m1!r}, 'before', {BLOCKS})") == [[node_id]] * BLOCKS, timeout=20)
    assert run(f"probe({m1!r})")[2], "the leader must serve the probe (else the fencing check below proves nothing)"
    standby = run(f"probe({m2!r})")
    assert not standby[2] and standby[3].startswith("UNAVAILABLE: this master is a standby") and standby[4] == m1

    run(f"watch_start({m1!r})")
    hosts["m1"].block(hosts["e"].address)
    cut = time.time()
    try:
        wait_for(lambda: run("etcd_leader()") == m2, timeout=20)
        refused = run(f"probe({m1!r})")
        assert not refused[2] and refused[3].startswith("UNAVAILABLE: this master is a standby"), refused
        assert m1 not in refused[3] and refused[4] != m1, f"a deposed leader names itself the leader: {refused}"
        wait_for(lambda: "no longer the leader" in cluster["m1"].stderr(), timeout=15)

        # the node registered again with M2, whose index holds every block written before the cut
        wait_for(lambda: run(f"alive_nodes({m2!r})") == [node_id], timeout=20)
        wait_for(lambda: run(f"holders({m2!r}, 'before', {BLOCKS})") == [[node_id]] * BLOCKS, timeout=20)
        run(f"put('during', {BLOCKS})")  # a namespace without a placement: the put asks M2
        assert run(f"wrong('before', {BLOCKS})") == [0, 0]
        assert run(f"wrong('during', {BLOCKS})") == [0, 0]
        assert run(f"holders({m2!r}, 'during', {BLOCKS})") == [[node_id]] * BLOCKS
    finally:
        hosts["m1"].unblock(hosts["e"].address)
        healed = time.time()

    # healed: M1 reads etcd again and stands by, naming M2; M2 keeps the leadership
    wait_for(lambda: run(f"probe({m1!r})")[4] == m2, timeout=30, interval=0.2)
    standing_by = time.time()
    time.sleep(2 * LEASE_TTL)  # M1 campaigns again meanwhile: it must not win while M2's lease lives
    assert run("etcd_leader()") == m2
    run(f"put('after', {BLOCKS})")
    for ns in ("before", "during", "after"):
        assert run(f"wrong({ns!r}, {BLOCKS})") == [0, 0], ns
    watched = run("watch_stop()")

    probes, leaders = watched["probes"], watched["leaders"]
    served = [p for p in probes if p[2]]
    refusals = [p for p in probes if not p[2]]
    assert refusals, "M1 never refused a call"
    first_refusal = min(p[0] for p in refusals)
    # fenced within the lease: its local deadline falls before etcd lets the key go
    late = [p for p in served if p[0] > cut + LEASE_TTL]
    assert not late, f"M1 served {len(late)} call(s) sent more than {LEASE_TTL} s after the cut"
    assert [p for p in probes if p[0] > cut + LEASE_TTL], "no probe was sent after the lease ran out"
    # and for good: nothing served after its first refusal, through the takeover and the heal
    assert not [p for p in served if p[0] > first_refusal], "M1 served again after refusing"
    assert all(p[3].startswith("UNAVAILABLE: this master is a standby") for p in refusals), {p[3] for p in refusals}
    assert not [p for p in refusals if p[4] == m1], "M1 named itself the leader while refusing"
    m2_since = min(t for t, who in leaders if who == m2)
    assert not [p for p in served if p[0] > m2_since], "M1 served a call sent once etcd named M2 the leader"
    assert all(who == m2 for t, who in leaders if t >= m2_since), f"the leadership moved again: {leaders}"
    print(
        f"partition: M1 refused {first_refusal - cut:.2f} s after the cut, M2 led {m2_since - cut:.2f} s after; "
        f"M1 stood by naming M2 {standing_by - healed:.2f} s after the heal"
    )

    m1_log, m2_log = cluster["m1"].stderr(), cluster["m2"].stderr()
    assert "no longer the leader: its lease deadline passed; standing by" in m1_log, m1_log
    assert "etcd unreachable" in m1_log, m1_log
    assert "no longer the leader" not in m2_log, m2_log
    for name, text in (
        ("master1", m1_log),
        ("master2", m2_log),
        ("node", cluster["node"].stderr()),
        ("client", agent.stderr()),
    ):
        assert "Traceback" not in text, f"{name}:\n{text[-3000:]}"
