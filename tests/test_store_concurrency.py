"""BlockStore under concurrent writers, readers and a pinner, with tiers small
enough that eviction, demotion and promotion never stop; then two races
replayed deterministically (a subclass runs a step between a read's lookup
and its SSD read).

Every value is self-describing: its first 8 bytes are a version number and
the rest is derived from (key, version), so a reader can check that whatever
it got is exactly one version that was written under that key, never a torn
mix, another key's bytes, or bytes from a reused arena extent. Each key has
one writer, so versions per key only grow and the last one written is known
at the end.
"""

from __future__ import annotations

import random
import struct
import sys
import threading
import time
import traceback

import pytest

from kvstore.node.config import StoreConfig
from kvstore.node.store import BlockStore
from kvstore.node.tiering import Tiering
from kvstore.policy import POLICIES

KiB = 1 << 10
GRANULE = 4096
MAX_BLOCK = 16 * KiB
N_KEYS = 160  # ~1.3 MiB of values against 512 KiB DRAM + 768 KiB SSD
PINNABLE = range(8)  # the pinner's keys: overwritten but never removed
HOT_KEYS = 24  # half the reads go to these, so readers often race on one block
WRITERS, READERS = 4, 4
TIME_LIMIT = 2.0  # seconds per thread at most; loops are bounded too
VERSION = struct.Struct("<Q")
SWITCH_INTERVAL = 5e-5  # seconds; CPython's default is 5 ms


def key(i: int) -> tuple[str, bytes]:
    return ("m", i.to_bytes(16, "little"))


def index_of(k) -> int:
    return int.from_bytes(k[1], "little")


def make_value(i: int, version: int) -> bytes:
    rng = random.Random(i * 1_000_003 + version)
    size = rng.randint(VERSION.size + 1, MAX_BLOCK)
    return VERSION.pack(version) + rng.randbytes(size - VERSION.size)


class Shared:
    """What the threads agree on: versions started/committed per key, and failures."""

    def __init__(self) -> None:
        self.started = [0] * N_KEYS  # highest version a writer began to write
        self.latest: list[int | None] = [None] * N_KEYS  # last committed version, None if removed
        self.errors: list[str] = []
        self.deadline = time.monotonic() + TIME_LIMIT
        self.reads = self.hits = 0

    def fail(self, message: str) -> None:
        self.errors.append(message)

    def running(self) -> bool:
        return not self.errors and time.monotonic() < self.deadline

    def verify(self, i: int, data: bytes | memoryview | None, how: str) -> None:
        """Any bytes read under key i must be exactly one version written under i."""
        self.reads += 1
        if data is None:
            return
        self.hits += 1
        if len(data) <= VERSION.size:
            self.fail(f"{how} key {i}: {len(data)} bytes, shorter than any value")
            return
        (version,) = VERSION.unpack_from(data)
        if not 1 <= version <= self.started[i]:
            self.fail(f"{how} key {i}: version {version} was never written (started {self.started[i]})")
        elif data != make_value(i, version):
            self.fail(f"{how} key {i}: bytes differ from version {version} ({len(data)} bytes)")


def guarded(shared: Shared, body):
    def run(*args):
        try:
            body(*args)
        except BaseException:
            shared.fail(traceback.format_exc())

    return run


def writer(store: BlockStore, shared: Shared, w: int) -> None:
    rng = random.Random(w)
    mine = [i for i in range(N_KEYS) if i % WRITERS == w]
    for _ in range(1500):
        if not shared.running():
            return
        i = rng.choice(mine)
        op = rng.random()
        if op < 0.12 and i not in PINNABLE:
            store.remove(key(i))
            shared.latest[i] = None
            continue
        version = shared.started[i] = shared.started[i] + 1
        value = make_value(i, version)
        if op < 0.75:
            store.put(key(i), value, depth=i % 8)
        elif op < 0.9:
            with store.reserve(key(i), len(value), depth=i % 8) as res:
                res.buffer[:] = value
        else:  # written but abandoned: never visible
            res = store.reserve(key(i), len(value))
            res.buffer[:] = value
            res.revoke()
            continue
        shared.latest[i] = version


def reader(store: BlockStore, shared: Shared, r: int) -> None:
    rng = random.Random(100 + r)
    buf = bytearray(MAX_BLOCK)
    for _ in range(4000):
        if not shared.running():
            return
        i = rng.randrange(N_KEYS) if rng.random() < 0.5 else rng.randrange(HOT_KEYS)
        op = rng.random()
        if op < 0.35:
            shared.verify(i, store.get(key(i)), "get")
        elif op < 0.7:
            n = store.get_into(key(i), buf)
            shared.verify(i, None if n is None else bytes(buf[:n]), "get_into")
        elif op < 0.9:
            with store.read(key(i)) as view:
                shared.verify(i, None if view is None else bytes(view), "read")
        else:
            chain = [key(j) for j in range(i, min(i + 4, N_KEYS))]
            n = store.match_prefix(chain)
            flags = store.batch_exists(chain)
            if not 0 <= n <= len(chain) or len(flags) != len(chain):
                shared.fail(f"match_prefix {n} / batch_exists {flags} out of range")


def pinner(store: BlockStore, shared: Shared, pinned: dict[int, int]) -> None:
    """Pins and unpins the PINNABLE keys; a block it holds a pin on must always read."""
    rng = random.Random(7)
    for _ in range(3000):
        if not shared.running():
            return
        i = rng.choice(PINNABLE)
        if pinned.get(i) and rng.random() < 0.4:
            if not store.unpin(key(i)):
                shared.fail(f"unpin of pinned key {i} returned False")
            pinned[i] -= 1
            if not pinned[i]:
                del pinned[i]
        elif pinned.get(i) or len(pinned) < 4:
            if store.pin(key(i)):
                pinned[i] = pinned.get(i, 0) + 1
        for j in list(pinned):
            if not store.exists(key(j)):
                shared.fail(f"pinned key {j} is gone")
        if pinned:
            j = rng.choice(list(pinned))
            data = store.get(key(j))
            if data is None:
                shared.fail(f"pinned key {j} missed on get (tier {store.tier_of(key(j))})")
            shared.verify(j, data, "pinned get")


def footprint(size: int) -> int:
    return -(-size // GRANULE) * GRANULE


def check_accounting(store: BlockStore) -> None:
    with store.tiering.evict_lock:  # no eviction pass in flight
        stats = store.stats()
        keys = store.keys()
        tiers = {k: store.tier_of(k) for k in keys}
        dram = [k for k in keys if tiers[k] == "dram"]
        ssd = [k for k in keys if tiers[k] == "ssd"]
        kept = [k for k in dram if store.describe(k).ssd_copy]  # an SSD record kept when it was promoted
        assert len(dram) + len(ssd) == len(keys) == len(store) == stats["store"]["blocks"]
        assert stats["dram"]["used"] == sum(footprint(store.size_of(k)) for k in dram)
        assert stats["dram"]["blocks"] == len(dram)
        assert stats["ssd"]["used"] == sum(store.size_of(k) for k in ssd + kept)
        assert stats["ssd"]["blocks"] == len(ssd) + len(kept)
        assert stats["dram"]["used"] <= stats["dram"]["capacity"]
        assert stats["ssd"]["used"] <= stats["ssd"]["capacity"]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_concurrent_readers_writers_pinner(tmp_path, policy):
    store = BlockStore(
        StoreConfig(
            dram_capacity=512 * KiB,
            granule=GRANULE,
            max_block_bytes=MAX_BLOCK,
            policy=policy,
            ssd_path=str(tmp_path / "ssd"),
            ssd_capacity=768 * KiB,
            background_eviction=True,
            eviction_batch=8,
        )
    )
    try:
        shared, pinned = Shared(), {}
        threads = [threading.Thread(target=guarded(shared, writer), args=(store, shared, w)) for w in range(WRITERS)]
        threads += [threading.Thread(target=guarded(shared, reader), args=(store, shared, r)) for r in range(READERS)]
        threads.append(threading.Thread(target=guarded(shared, pinner), args=(store, shared, pinned)))
        switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL)  # preempt threads often: more interleavings per second
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=30)
        finally:
            sys.setswitchinterval(switch_interval)
        assert not any(t.is_alive() for t in threads), "a thread hung"
        assert not shared.errors, "\n".join(shared.errors[:5])

        stats = store.stats()
        assert stats["dram"]["demotions"] > 0 and stats["ssd"]["evictions"] > 0, stats
        assert stats["ssd"]["promotions"] > 0 and shared.hits > 0, stats

        store.evict()
        check_accounting(store)
        assert stats["ssd"]["checksum_failures"] == 0
        assert store.stats()["store"]["pinned"] == len(pinned)
        for i in range(N_KEYS):
            data = store.get(key(i))
            if i in pinned:
                assert data is not None, f"pinned key {i} was lost"
            if data is not None:
                assert shared.latest[i] is not None, f"removed key {i} reads {len(data)} bytes"
                assert data == make_value(i, shared.latest[i]), f"key {i} is not its last written version"
        check_accounting(store)
    finally:
        store.close()


# --- races replayed deterministically ---------------------------------------------


class InterleavedStore(BlockStore):
    """Runs ``between()`` once, right after the next read has looked its block up
    (and seen it in SSD) but before it reads the SSD tier."""

    between = None

    def _lookup(self, key):
        found = super()._lookup(key)
        hook, self.between = self.between, None
        if hook is not None:
            hook()
        return found


def small_store(tmp_path, **parts) -> InterleavedStore:
    return InterleavedStore(
        StoreConfig(
            dram_capacity=128 * KiB,
            max_block_bytes=64 * KiB,
            ssd_path=str(tmp_path / "ssd"),
            ssd_capacity=1024 * KiB,
            policy="lru",
            background_eviction=False,
        ),
        **parts,
    )


def block(tag: int, size: int) -> bytes:
    return random.Random(tag).randbytes(size)


def test_read_racing_a_promotion_keeps_the_block(tmp_path):
    """Reader A finds a pinned block in SSD; reader B reads and promotes it
    before A reads SSD. A must still get the bytes (from DRAM), and the block
    must stay stored and pinned."""
    with small_store(tmp_path) as store:
        for i in range(4):
            store.put(key(i), block(i, 60 * KiB))
        assert store.tier_of(key(0)) == "ssd"
        store.remove(key(3))  # room in DRAM, so a hit on key 0 promotes it
        assert store.pin(key(0))
        store.between = lambda: store.get(key(0))
        assert store.get(key(0)) == block(0, 60 * KiB)
        assert store.tier_of(key(0)) == "dram"
        assert store.stats()["store"]["pinned"] == 1
        store.between = lambda: store.get(key(1))
        out = bytearray(64 * KiB)
        assert store.get_into(key(1), out) == 60 * KiB and out[: 60 * KiB] == block(1, 60 * KiB)
        assert store.exists(key(1))


def test_get_racing_an_overwrite_with_a_larger_value(tmp_path):
    """Reader A finds a 20 KiB block in SSD; meanwhile it is overwritten with
    60 KiB and that value is demoted to SSD too. get() must return a value the
    key held (the new one), not raise BufferTooSmall."""
    with small_store(tmp_path) as store:
        store.put(key(0), block(0, 20 * KiB))
        store.put(key(1), block(1, 60 * KiB))
        store.put(key(2), block(2, 60 * KiB))
        assert store.tier_of(key(0)) == "ssd"

        def overwrite_and_demote():
            store.put(key(0), block(100, 60 * KiB))
            store.put(key(3), block(3, 60 * KiB))
            store.put(key(4), block(4, 60 * KiB))
            assert store.tier_of(key(0)) == "ssd" and store.size_of(key(0)) == 60 * KiB

        store.between = overwrite_and_demote
        assert store.get(key(0)) == block(100, 60 * KiB)
        assert store.get(key(0)) == block(100, 60 * KiB)


class HookedTiering(Tiering):
    """Runs ``during_write(victims)`` once, while a demotion batch is being
    written to SSD (outside the store lock, where other threads may act)."""

    during_write = None

    def _write_to_ssd(self, victims):
        hook, self.during_write = self.during_write, None
        if hook is not None:
            hook(victims)
        return super()._write_to_ssd(victims)


def test_put_survives_its_demotion_victim_being_pinned_meanwhile(tmp_path):
    """An inline make-room pass picks a victim and, while its SSD copy is
    written, another thread pins it. The pass moves nothing, but other blocks
    are still evictable, so the put must go on evicting, not raise CapacityError."""
    with small_store(tmp_path, tiering=HookedTiering) as store:
        tiering = store.tiering
        store.put(key(0), block(0, 60 * KiB))
        store.put(key(1), block(1, 60 * KiB))
        tiering.during_write = lambda victims: [store.pin(k) for k, _, _ in victims]
        store.put(key(2), block(2, 60 * KiB))
        assert store.tier_of(key(0)) == "dram" and store.stats()["store"]["pinned"] == 1
        assert store.tier_of(key(1)) == "ssd" and store.tier_of(key(2)) == "dram"
        for i in range(3):
            assert store.get(key(i)) == block(i, 60 * KiB)
