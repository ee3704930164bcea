"""The election's fencing on a fake etcd and a hand-moved clock (no etcd needed; tests/test_failover.py has the real one)."""

from __future__ import annotations

import pytest

from kvstore.master.election import Election, leader_key
from kvstore_client.etcd import EtcdUnavailable
from kvstore_client.proto.etcd import kv_pb2


class FakeEtcd:
    """Leases that live while someone says so; one key space; `down` makes every call fail."""

    def __init__(self):
        self.keys: dict[bytes, kv_pb2.KeyValue] = {}
        self.leases: dict[int, int] = {}
        self.next_lease, self.down = 1, False
        self.revision = 0

    def _check(self):
        if self.down:
            raise EtcdUnavailable("down")

    def grant(self, ttl):
        self._check()
        lease, self.next_lease = self.next_lease, self.next_lease + 1
        self.leases[lease] = ttl
        return lease, ttl

    def keep_alive(self, lease):
        self._check()
        return self.leases.get(lease, -1)

    def expire(self, lease):
        self.leases.pop(lease, None)
        self.keys = {k: v for k, v in self.keys.items() if v.lease != lease}

    def get(self, key):
        self._check()
        return self.keys.get(key)

    def create(self, key, value, lease):
        self._check()
        if key in self.keys:
            return False, self.keys[key]
        self.put(key, value, lease)
        return True, self.keys[key]

    def put(self, key, value, lease=0):
        """What anyone with write access may do."""
        self.revision += 1
        self.keys[key] = kv_pb2.KeyValue(key=key, value=value, lease=lease, mod_revision=self.revision)

    def replace_if_revision(self, key, mod_revision, value, lease=0):
        self._check()
        if key not in self.keys or self.keys[key].mod_revision != mod_revision:
            return False
        if value is None:
            del self.keys[key]
        else:
            self.put(key, value, lease)
        return True

    def delete_if_lease(self, key, lease):
        if key in self.keys and self.keys[key].lease == lease:
            del self.keys[key]
            return True
        return False

    def revoke(self, lease):
        self.expire(lease)

    def close(self):
        pass


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def world():
    return FakeEtcd(), Clock()


def elect(etcd, clock, address, elected=None, pool_key=None):
    return Election(etcd, "/kv", address, ttl_s=2, clock=clock, on_elected=elected, pool_key=pool_key)


def test_the_first_to_create_the_key_leads_and_the_other_stands_by(world):
    etcd, clock = world
    resets = []
    a, b = elect(etcd, clock, "a:1", lambda: resets.append("a")), elect(etcd, clock, "b:1")
    a._step(), b._step()
    assert a.is_leader() and not b.is_leader()
    assert b.leader() == "a:1" and resets == ["a"]
    assert etcd.keys[leader_key("/kv")].value == b"a:1"


def test_a_paused_leader_refuses_before_talking_to_etcd_again(world):
    etcd, clock = world
    a, b = elect(etcd, clock, "a:1"), elect(etcd, clock, "b:1")
    a._step(), b._step()
    clock.now += 1.8  # past 2 s - max(0.25 s, 10 %): the local deadline, though etcd still holds the lease
    assert not a.is_leader()
    etcd.expire(a._lease)  # etcd lets it go at 2 s; the standby takes the key
    clock.now += 0.5
    b._step()
    assert b.is_leader() and b.terms == 1
    a._step()  # the resumed leader learns its lease is gone, then campaigns anew as a standby
    a._step()
    assert not a.is_leader() and a.leader() == "b:1"


def test_keep_alives_extend_the_deadline_and_an_unreachable_etcd_ends_leadership(world):
    etcd, clock = world
    a = elect(etcd, clock, "a:1")
    a._step()
    for _ in range(10):  # keep-alives every 2/3 s: leadership lasts
        clock.now += 0.7
        a._step()
        assert a.is_leader()
    etcd.down = True
    clock.now += 0.7
    with pytest.raises(EtcdUnavailable):
        a._step()
    assert a.is_leader()  # still inside the deadline of the last keep-alive
    clock.now += 1.1  # 1.8 s after it: past 2 s less the margin
    assert not a.is_leader()


def test_a_leader_whose_key_changed_steps_down(world):
    etcd, clock = world
    a = elect(etcd, clock, "a:1")
    a._step()
    etcd.put(leader_key("/kv"), b"z:9", lease=etcd.grant(2)[0])  # another master's, on its lease
    a._step()
    assert not a.is_leader() and a.leader() == "z:9"


KEY = leader_key("/kv")
POOL = b"p" * 32


def test_a_key_on_no_lease_is_written_over_by_the_leader_and_deleted_by_a_standby(world):
    etcd, clock = world
    a, b = elect(etcd, clock, "a:1"), elect(etcd, clock, "b:2")
    a._step()
    etcd.put(KEY, b"evil:1")  # a client of etcd writes the key on no lease
    a._step()
    assert a.is_leader() and etcd.keys[KEY].value == b"a:1" and etcd.keys[KEY].lease == a._lease
    a.stop()  # resigns: the key is gone
    etcd.put(KEY, b"evil:1")
    b._step()  # a standby deletes the forged key ...
    assert KEY not in etcd.keys and b.leader() is None
    b._step()  # ... and is elected at its next poll
    assert b.is_leader() and etcd.keys[KEY].value == b"b:2"


def test_with_an_access_file_only_keys_with_the_pools_proof_count(world):
    from kvstore_client.leader_record import believable, encode

    etcd, clock = world
    a, b = elect(etcd, clock, "a:1", pool_key=POOL), elect(etcd, clock, "b:2", pool_key=POOL)
    a._step()
    assert believable(etcd.keys[KEY], POOL) and not believable(etcd.keys[KEY], b"q" * 32)
    forger_lease = etcd.grant(2)[0]
    etcd.put(KEY, encode("evil:1", forger_lease, None), lease=forger_lease)  # a live lease, but no proof
    a._step()
    assert a.is_leader() and etcd.keys[KEY].value.startswith(b"a:1 ")
    etcd.put(KEY, encode("evil:1", forger_lease, b"q" * 32), lease=forger_lease)  # a proof under another key
    b._step()
    assert not b.is_leader() and b.leader() is None
    a._step()
    assert a.is_leader() and etcd.keys[KEY].value.startswith(b"a:1 ")
    b._step()
    assert not b.is_leader() and b.leader() == "a:1"  # the real leader's key: followed
    etcd.put(KEY, etcd.keys[KEY].value, lease=forger_lease)  # the real value, copied onto another lease
    assert not believable(etcd.keys[KEY], POOL)


def test_stop_resigns(world):
    etcd, clock = world
    a = elect(etcd, clock, "a:1")
    a._step()
    a.stop()
    assert leader_key("/kv") not in etcd.keys and not etcd.leases
