"""Several hosts for real: the master, nodes and clients each in a network namespace of their own.

Hosts (bench.netns): M runs the master, A and B a storage node each, C only clients;
every host has its own address on one bridge and its own machine id, and every
service and client is a real process in its host, speaking TCP across the bridge and,
within a host, the Unix socket and shared memory. The pool checks tokens (``--auth``):
nodes prove theirs to the master, clients theirs to the master and the nodes.

Checked: same-host detection (a client on A maps A's arena and reads B's blocks over
TCP, though B's socket and arena are visible in the machine's /dev/shm too), local-first
placement (A's puts land on A's node; C's, with no node of its own, spread), the master
cut off from everyone and back (nodes rejoin, the index is rebuilt, no wrong bytes), and
a node killed (kill -9) while its blocks have replicas on another host.

The tests share one pool (starting it is most of the time); the last one kills B's node.
"""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.access_files import ADMIN, TENANT_A, WRONG, write_access_file
from bench.netns import ETC_NETNS, PREFIX, Network, NetnsUnavailable, unavailable
from tests.processes import start_master, start_node, wait_for

KiB = 1024
BLOCK = 256 * KiB
TTL = 3.0  # the master's node lease: a node silent this long is dropped with its blocks

# Runs in each client host's interpreter: MASTER and TOKEN are set first.
AGENT = r'''
import os, random
from kvstore_client import Client, make_key
from kvstore_client.credentials import Credentials
from kvstore_client.errors import KVStoreError
from kvstore_client.hostid import machine_id
from kvstore_client.transport import TcpConnection

clients = {}

def client(name, **kwargs):
    """One Client per name, made on first use (its connections persist between calls)."""
    if name not in clients:
        clients[name] = Client(MASTER, **{"token": TOKEN, **kwargs})
    return clients[name]

def keys(ns, n):
    return [make_key(ns, b"block-%d" % i) for i in range(n)]

def value(ns, i, size):
    return random.Random(f"{ns}/{i}").randbytes(size)

def put(name, ns, n, size):
    c = client(name)
    for i, key in enumerate(keys(ns, n)):
        c.put(key, value(ns, i, size))

def wrong(name, ns, n, size):
    """The blocks of ns read missing or not as written."""
    got = client(name).batch_get(keys(ns, n))
    return [i for i, v in enumerate(got) if v != value(ns, i, size)]

def holders(ns, n):
    """Per block, the node ids the master's index lists for it (asked afresh)."""
    index = {key[1]: i for i, key in enumerate(keys(ns, n))}
    out = [[] for _ in range(n)]
    for entry in client("probe").list_keys(ns, limit=10 * n).keys:
        out[index[entry.digest]] = sorted(r.node_id for r in entry.replicas)
    return out

def nodes():
    """node id -> (alive, machine id, data address, unix socket), as the master has them."""
    return {n.info.node_id: [n.alive, n.info.machine_id, n.info.data_address, n.info.unix_socket]
            for n in client("probe").cluster_status().nodes}

def transports(name):
    """node id -> what this thread's connection of client ``name`` to it is."""
    out = {}
    for node_id, conn in client(name)._local.__dict__.get("conns", {}).items():
        sock = conn._sock
        out[node_id] = {"kind": type(conn).__name__, "one_sided": bool(getattr(conn, "one_sided", False)),
                        "local": str(sock.getsockname()), "peer": str(sock.getpeername())}
    return out

def read_direct(name, node_id, ns, n, size):
    """Blocks of ns read through node_id's block directory alone (no frame at all), as written."""
    conn = client(name)._local.conns[node_id]
    got = conn.read_direct(keys(ns, n))
    return [i for i, v in enumerate(got) if v == value(ns, i, size)]

def refused(call):
    try:
        call()
    except KVStoreError as exc:
        return type(exc).__name__
    return None
'''


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("multihost")
    access = str(write_access_file(tmp / "auth"))
    services = []
    try:
        net = Network()
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))
    try:
        try:
            m, a, b, c = (net.add_host(name) for name in ("m", "a", "b", "c"))
        except NetnsUnavailable as exc:
            pytest.skip(str(exc))
        agents = {h.name: h.python() for h in (m, a, b, c)}  # they import while the services start
        master = start_master(ttl=TTL, extra=("--host", m.address, "--auth", access), prefix=tuple(m.command([])))
        services.append(master)
        address = master.record["master"]

        def node(host):
            return start_node(
                address,
                tmp / host.name,
                dram="64MiB",
                ssd="0",
                extra=("--host", host.address, "--auth", access),
                prefix=tuple(host.command([])),
            )

        with ThreadPoolExecutor(2) as pool_:
            node_a, node_b = pool_.map(node, (a, b))
        services += [node_a, node_b]
        setup = f"MASTER = {address!r}\nTOKEN = {TENANT_A!r}\n" + AGENT
        for agent in agents.values():
            agent.exec(setup, wait=False)
        for agent in agents.values():
            agent.result(timeout=120)
        ids = {"a": node_a.record["node_id"], "b": node_b.record["node_id"]}
        wait_for(
            lambda: sorted(k for k, v in agents["c"].eval("nodes()").items() if v[0]) == sorted(ids.values()),
            timeout=30,
        )
        yield {
            "net": net,
            "hosts": {"m": m, "a": a, "b": b, "c": c},
            "agents": agents,
            "ids": ids,
            "services": {"master": master, "a": node_a, "b": node_b},
        }
    finally:
        for service in reversed(services):
            service.close()
        net.close()


def run(agent, code: str, timeout: float = 60):
    return agent.eval(code, timeout=timeout)


def spreader(agent) -> None:
    """Client "spreader" in ``agent``'s host: a placement per put (by default one serves up to 64 MiB
    of puts and a second). The master ranks by free DRAM net of what it placed since, so from a
    host without a node, puts to equally empty nodes alternate."""
    agent.exec(f"client('spreader', placement_bytes={BLOCK}, placement_ttl=0.001)")


def test_each_host_has_its_own_machine_id_and_address(pool):
    hosts, agents, ids = pool["hosts"], pool["agents"], pool["ids"]
    for name in ("m", "a", "b", "c"):
        assert run(agents[name], "machine_id()") == hosts[name].machine_id
    nodes = run(agents["c"], "nodes()")
    for name in ("a", "b"):
        alive, machine, data, _ = nodes[ids[name]]
        assert alive and machine == hosts[name].machine_id
        assert data.rsplit(":", 1)[0] == hosts[name].address
    assert len({h.machine_id for h in hosts.values()}) == 4


def test_local_first_placement_and_spreading_from_a_host_without_a_node(pool):
    """The first test to put anything: the nodes start equally empty."""
    a, c, ids = pool["agents"]["a"], pool["agents"]["c"], pool["ids"]
    n = 16
    spreader(c)
    run(c, f"put('spreader', 'acme-lf-c', {n}, {BLOCK})")
    on = wait_for(lambda: (h := run(c, f"holders('acme-lf-c', {n})")) and all(h) and h, timeout=10)
    counts = {node: sum(h == [node] for h in on) for node in ids.values()}
    assert sum(counts.values()) == n and min(counts.values()) >= n // 4, counts
    # A is now as full as B or fuller, and a put from A still lands on A
    spreader(a)
    run(a, f"put('spreader', 'acme-lf-a', {n}, {BLOCK})")
    wait_for(lambda: run(c, f"holders('acme-lf-a', {n})") == [[ids["a"]]] * n, timeout=10)
    assert run(c, f"wrong('reader', 'acme-lf-c', {n}, {BLOCK})") == []


def test_a_reads_its_own_node_through_shared_memory_and_the_other_host_over_tcp(pool):
    hosts, agents, ids = pool["hosts"], pool["agents"], pool["ids"]
    a, c = agents["a"], agents["c"]
    run(a, f"put('wa', 'acme-here', 8, {BLOCK})")
    run(agents["b"], f"put('wb', 'acme-there', 8, {BLOCK})")
    for ns, name in (("acme-here", "a"), ("acme-there", "b")):  # local first
        wait_for(lambda ns=ns, name=name: run(c, f"holders({ns!r}, 8)") == [[ids[name]]] * 8, timeout=10)
    # B's socket is a file in this machine's /dev/shm, visible from A: only the machine id says "elsewhere"
    sock_b = run(c, "nodes()")[ids["b"]][3]
    assert sock_b and run(a, f"os.path.exists({sock_b!r})")

    assert run(a, f"wrong('reader', 'acme-here', 8, {BLOCK})") == []
    assert run(a, f"wrong('reader', 'acme-there', 8, {BLOCK})") == []
    used = run(a, "transports('reader')")
    assert set(used) == {ids["a"], ids["b"]}, used
    # a tenant's same-host reads lease blocks and copy them out of the mapped arena (the block
    # directory lists every tenant's blocks, so the node offers it to unconfined callers only)
    assert used[ids["a"]]["kind"] == "ShmConnection" and not used[ids["a"]]["one_sided"], used
    assert used[ids["b"]]["kind"] == "TcpConnection", used
    assert hosts["b"].address in used[ids["b"]]["peer"] and hosts["a"].address in used[ids["b"]]["local"], used

    # an admin's reads on A come straight out of A's block directory, no frame sent
    a.exec(f"client('admin-reader', token={ADMIN!r})")
    assert run(a, f"wrong('admin-reader', 'acme-here', 8, {BLOCK})") == []
    assert run(a, f"wrong('admin-reader', 'acme-there', 8, {BLOCK})") == []
    used = run(a, "transports('admin-reader')")
    assert used[ids["a"]]["kind"] == "ShmConnection" and used[ids["a"]]["one_sided"], used
    assert used[ids["b"]]["kind"] == "TcpConnection", used
    assert run(a, f"read_direct('admin-reader', {ids['a']!r}, 'acme-here', 8, {BLOCK})") == list(range(8))


def test_other_hosts_prove_their_tokens(pool):
    c, ids = pool["agents"]["c"], pool["ids"]
    data_b = run(c, "nodes()")[ids["b"]][2]
    assert run(c, f"refused(lambda: Client(MASTER, token={WRONG!r}).cluster_status())") == "Unauthenticated"
    assert (
        run(c, f"refused(lambda: TcpConnection({data_b!r}, credentials=Credentials({WRONG!r})))") == "Unauthenticated"
    )
    assert run(c, f"refused(lambda: TcpConnection({data_b!r}, credentials=Credentials(TOKEN)).close())") is None


def test_master_cut_off_then_back_nodes_rejoin_and_bytes_stay_right(pool):
    hosts, agents, ids = pool["hosts"], pool["agents"], pool["ids"]
    m, a, c = agents["m"], agents["a"], agents["c"]
    n = 8
    run(a, f"put('wa', 'acme-cut-a', {n}, {BLOCK})")
    run(c, f"put('wc', 'acme-cut-c', {n}, {BLOCK})")
    before = {
        ns: wait_for(lambda ns=ns: (h := run(c, f"holders({ns!r}, {n})")) and all(h) and h, timeout=10)
        for ns in ("acme-cut-a", "acme-cut-c")
    }
    a.exec(f"client('cut', token={ADMIN!r})")  # unconfined: reads A's block directory (see above)
    assert run(a, f"wrong('cut', 'acme-cut-a', {n}, {BLOCK})") == []  # opens A's shared-memory path

    hosts["m"].set_link(False)
    try:
        # the master (asked inside its own host) stops hearing the nodes and drops them with their blocks
        wait_for(lambda: run(m, "nodes()") == {}, timeout=TTL + 15)
        assert run(m, f"holders('acme-cut-c', {n})") == [[]] * n
        # meanwhile A's client reads A's blocks through shared memory without asking the master
        assert run(a, f"read_direct('cut', {ids['a']!r}, 'acme-cut-a', {n}, {BLOCK})") == list(range(n))
        assert run(a, f"wrong('cut', 'acme-cut-a', {n}, {BLOCK})") == []
    finally:
        hosts["m"].set_link(True)

    def rejoined():
        nodes = run(c, "nodes()")
        return all(nodes.get(i, [False])[0] for i in ids.values()) and all(
            run(c, f"holders({ns!r}, {n})") == held for ns, held in before.items()
        )

    wait_for(rejoined, timeout=45, interval=0.5)
    for agent in (a, c):
        for ns in before:
            assert run(agent, f"wrong('after-cut', {ns!r}, {n}, {BLOCK})") == [], (agent.host.name, ns)


def test_a_node_killed_on_b_its_replicated_blocks_still_read_from_a(pool):
    agents, ids = pool["agents"], pool["ids"]
    a, c = agents["a"], agents["c"]
    n = 8
    c.exec("client('twice', replicas=2)")
    run(c, f"put('twice', 'acme-rep', {n}, {BLOCK})")
    both = sorted(ids.values())
    wait_for(lambda: run(c, f"holders('acme-rep', {n})") == [both] * n, timeout=10)
    run(c, f"wrong('rep-reader', 'acme-rep', {n}, {BLOCK})")  # connections to both nodes, B's about to break

    pool["services"]["b"].kill()  # SIGKILL: no deregistration, B's lease still live at the master
    assert run(a, f"wrong('rep-a', 'acme-rep', {n}, {BLOCK})") == []
    assert run(c, f"wrong('rep-reader', 'acme-rep', {n}, {BLOCK})") == []  # from A, over TCP
    assert run(c, f"wrong('rep-fresh', 'acme-rep', {n}, {BLOCK})") == []
    assert run(c, "transports('rep-fresh')")[ids["a"]]["kind"] == "TcpConnection"
    wait_for(lambda: ids["b"] not in run(c, "nodes()"), timeout=TTL + 15)  # dropped with its blocks
    assert run(c, f"holders('acme-rep', {n})") == [[ids["a"]]] * n
    assert run(c, f"wrong('rep-later', 'acme-rep', {n}, {BLOCK})") == []


def test_a_network_leaves_nothing_behind_and_sweeps_what_dead_runs_left():
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer runs: names made under it are an earlier run's leftovers
    stale = f"{PREFIX}{gone.pid}-zz"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    (ETC_NETNS / stale).mkdir(parents=True, exist_ok=True)
    with Network() as net:  # sweeps what dead runs left
        host = net.add_host("x")
        assert stale not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert not (ETC_NETNS / stale).exists()
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert host.netns in names and net.switch in names
        sleeper = subprocess.Popen(host.command(["sleep", "600"]))
    assert sleeper.wait(timeout=10) != 0  # killed with its host
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert host.netns not in names and net.switch not in names
    assert not (ETC_NETNS / host.netns).exists()
