"""Read leases of the shared-memory transport: late release, expiry, and reads that race an expiry.

A same-host read leases its block, copies it and does not send a RELEASE of
its own: the lease id rides along with the connection's next request, or goes
out with ``flush()``. The node expires leases older than its lease TTL, so a
read whose lease lapsed before its copy ended can see the space reused; the
checksum (or, without verification, the clock) catches that and the read is
redone. (Reads through the block directory take no lease: these connections
are made with ``one_sided=False``; test_transport_same_host.py covers that
path.) These tests drive a node in this process so they can look at its
store, and force the race with a connection whose LEASE reply is followed,
before the copy, by the lease expiring and writers reusing the space.
"""

from __future__ import annotations

import time

import pytest
import xxhash

from kvstore.node.config import StoreConfig
from kvstore.node.store import BlockStore
from kvstore.transport.server import DataPlaneServer
from kvstore_client.transport import ShmConnection

KiB = 1 << 10
BLOCK = 64 * KiB
TINY_TTL = 0.05


def key(name: str) -> tuple[str, bytes]:
    return ("ns", xxhash.xxh3_128_digest(name.encode()))


def value(tag: str, size: int = BLOCK) -> bytes:
    seed = xxhash.xxh3_128_digest(tag.encode())
    return (seed * (size // len(seed) + 1))[:size]


def wait_until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.002)


@pytest.fixture
def make_node(tmp_path):
    """Factory of in-process nodes (a small DRAM-only store) with a given lease TTL."""
    started = []

    def make(lease_ttl):
        store = BlockStore(StoreConfig(dram_capacity=16 * BLOCK, max_block_bytes=BLOCK, background_eviction=False))
        server = DataPlaneServer(store, unix_path=str(tmp_path / f"dp{len(started)}.sock"), lease_ttl=lease_ttl)
        started.append((store, server.start()))
        return server

    yield make
    for store, server in started:
        server.stop()
        store.close()


def test_a_finished_lease_is_released_by_the_next_request(make_node):
    server = make_node(lease_ttl=None)  # nothing expires: only the client releases
    store, k = server.store, key("next-request")
    store.put(k, value("next-request"))
    with ShmConnection(server.unix_path, one_sided=False) as conn:
        assert conn.get(k) == value("next-request")
        assert store.dram.is_leased(k)  # no RELEASE frame of its own...
        assert conn.exists(key("anything else")) is False
        assert not store.dram.is_leased(k)  # ...it went out in front of the next request
        buffer = bytearray(BLOCK)
        assert conn.get_into(k, buffer) == BLOCK and store.dram.is_leased(k)
        conn.flush()
        assert not store.dram.is_leased(k)
        conn.flush()  # nothing pending: a no-op
        assert conn.get_into_many([k, key("missing")], [buffer, bytearray(1)]) == [BLOCK, None]
        assert store.dram.is_leased(k)
    wait_until(lambda: not store.dram.is_leased(k))  # closing the connection ends its leases


def test_leases_of_an_idle_client_expire(make_node):
    server = make_node(lease_ttl=0.2)
    store, k = server.store, key("idle")
    store.put(k, value("idle"))
    with ShmConnection(server.unix_path, one_sided=False) as conn:
        assert conn.lease_ttl == 0.2
        started = time.monotonic()
        assert conn.get_into(k, bytearray(BLOCK)) == BLOCK and store.dram.is_leased(k)
        wait_until(lambda: not store.dram.is_leased(k))
        assert time.monotonic() - started >= 0.2
        # the next request still carries the expired id: not an error, the connection goes on
        assert conn.get(k) == value("idle")
        conn.flush()
        assert not store.dram.is_leased(k)


def test_held_leases_do_not_expire(make_node):
    server = make_node(lease_ttl=TINY_TTL)
    store, k = server.store, key("held")
    store.put(k, value("held"))
    with ShmConnection(server.unix_path) as conn:
        lease = conn.lease_many([k])
        time.sleep(TINY_TTL * 6)
        assert store.dram.is_leased(k) and bytes(lease.views[0]) == value("held")
        lease.release()
        conn.ping()
        assert not store.dram.is_leased(k)


class StallingShm(ShmConnection):
    """Between a LEASE reply and the copy, lets the lease expire and the space be reused:
    for the next ``stalls`` leases of ``victim``, waits until the node no longer holds the
    lease, stores a new version of the victim elsewhere and fills the store with other
    blocks until one of them lies where the leased bytes were."""

    def __init__(self, target: str, store: BlockStore, victim, stalls: int, **options):
        super().__init__(target, **options)
        self.store, self.victim, self.stalls = store, victim, stalls
        self.version, self.reused, self.victim_leases = 0, [], 0

    def _lease(self, keys, chunk, flags):
        lease_id, items = super()._lease(keys, chunk, flags)
        for j, (status, offset, size, _) in zip(chunk, items):
            if keys[j] == self.victim and status == 0:
                self.victim_leases += 1
                if self.stalls:
                    self.stalls -= 1
                    self._reuse(offset, size)
        return lease_id, items

    def _reuse(self, offset: int, size: int) -> None:
        store, dram = self.store, self.store.dram
        wait_until(lambda: not dram.is_leased(self.victim))  # the reaper expired our lease
        self.version += 1
        store.put(self.victim, value(f"victim-{self.version}"))
        for i in range(64):
            filler = key(f"filler-{self.version}-{i}")
            store.put(filler, value(f"filler-{self.version}-{i}"))
            extent = dram.location(filler)
            if extent is not None and extent.offset < offset + size and offset < extent.offset + extent.size:
                self.reused.append(offset)
                return
        raise AssertionError("no block came to lie where the leased one was")


@pytest.mark.parametrize("stalls", [1, 2], ids=["leased-again", "then-over-the-socket"])
@pytest.mark.parametrize("verify", [True, False], ids=["checksum", "clock"])
@pytest.mark.parametrize("call", ["get_into", "get_into_many", "get"])
def test_a_read_whose_lease_expired_never_returns_wrong_bytes(make_node, stalls, verify, call):
    server = make_node(lease_ttl=TINY_TTL)
    store, victim = server.store, key("victim")
    store.put(victim, value("victim-0"))
    with StallingShm(server.unix_path, store, victim, stalls, verify=verify, one_sided=False) as conn:
        buffer = bytearray(BLOCK)
        if call == "get_into":
            got = buffer if conn.get_into(victim, buffer) == BLOCK else None
        elif call == "get_into_many":
            sizes = conn.get_into_many([key("other"), victim], [bytearray(1), buffer])
            got = buffer if sizes == [None, BLOCK] else None
        else:
            got = conn.get(victim)
        assert len(conn.reused) == stalls  # the race really happened
        assert conn.victim_leases == 2  # leased, leased once more, then (after a second damaged copy) GET
        current = store.get(victim)
        assert got is None or bytes(got) == current == value(f"victim-{conn.version}")
