"""Crash and restart of a BlockStore with an SSD tier.

DRAM is volatile: the DRAM tier is a shared-memory arena that the store
unlinks on close (and that dies with a killed process), so blocks that were
in DRAM are gone after a restart. The SSD tier (lmdb) is durable against a
process crash, kill -9 included: every block that was in SSD comes back with
its exact bytes and its prefix depth, re-indexed from record headers. A
damaged SSD record reads as a miss, never as wrong bytes.
"""

from __future__ import annotations

import os
import random
import selectors
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import lmdb

from kvstore.node.config import StoreConfig
from kvstore.node.store import BlockStore

KiB = 1 << 10
REPO_ROOT = Path(__file__).resolve().parents[1]


def key(i: int) -> tuple[str, bytes]:
    return ("m", i.to_bytes(16, "little"))


def value_of(i: int, size: int = 16 * KiB) -> bytes:
    return random.Random(i).randbytes(size)


def open_store(ssd_path, **overrides) -> BlockStore:
    options = dict(
        dram_capacity=64 * KiB,
        max_block_bytes=16 * KiB,
        ssd_path=str(ssd_path),
        ssd_capacity=256 * KiB,
        policy="lru",
        ssd_policy="length_aware",
        background_eviction=False,
    )
    options.update(overrides)
    return BlockStore(StoreConfig(**options))


# --- (a) clean close and reopen -------------------------------------------------------------------


def test_clean_reopen_keeps_ssd_blocks_and_their_depths_drops_dram(tmp_path):
    """A 12-block chain (depth = position) is pushed to SSD by 4 fillers that
    stay in DRAM. After close and reopen the chain is back in SSD with exact
    bytes and depths, the fillers are gone, and the length-aware SSD policy
    still sees the depths: under pressure it drops the deepest blocks first."""
    chain = [key(i) for i in range(12)]
    sizes = [16 * KiB - 100 * i for i in range(12)]
    fillers = [key(100 + i) for i in range(4)]
    with open_store(tmp_path / "ssd") as store:
        for depth, (k, size) in enumerate(zip(chain, sizes)):
            store.put(k, value_of(depth, size), depth=depth)
        for i, k in enumerate(fillers):
            store.put(k, value_of(100 + i))
        assert [store.tier_of(k) for k in chain] == ["ssd"] * 12
        assert [store.tier_of(k) for k in fillers] == ["dram"] * 4
        arena = store.dram.arena.path
    assert not os.path.exists(arena)  # close unlinks the DRAM arena

    with open_store(tmp_path / "ssd") as store:
        assert len(store) == 12 and store.stats()["store"]["blocks"] == 12
        assert [store.tier_of(k) for k in chain] == ["ssd"] * 12
        assert not any(store.exists(k) for k in fillers)  # DRAM is volatile
        assert [store.size_of(k) for k in chain] == sizes
        assert [store.ssd.depth_of(k) for k in chain] == list(range(12))
        stats = store.stats()
        assert stats["ssd"]["used"] == sum(sizes) and stats["ssd"]["blocks"] == 12
        assert stats["dram"]["used"] == 0 and stats["dram"]["blocks"] == 0

        # Behaviour: new blocks demoted into SSD push it past its high watermark.
        # With depths lost every old block would tie at depth 0 and the oldest
        # (chain[0], first in the index) would go first; with depths kept the
        # deepest go first, so the chain's survivors are a prefix of it.
        for i in range(8):
            store.put(key(200 + i), value_of(200 + i))
        survivors = [i for i, k in enumerate(chain) if store.exists(k)]
        assert 0 < len(survivors) < 12, survivors
        assert survivors == list(range(len(survivors))), f"not the deepest dropped first: {survivors}"
        assert store.stats()["ssd"]["evictions"] == 12 - len(survivors)
        for i in survivors:
            assert store.get(chain[i]) == value_of(i, sizes[i])


# --- (b) kill -9 ------------------------------------------------------------------------------------

CHILD = textwrap.dedent("""
    import random, sys
    from kvstore.node.config import StoreConfig
    from kvstore.node.store import BlockStore

    KiB = 1 << 10
    def key(i):
        return ("m", i.to_bytes(16, "little"))
    def value_of(i):
        rng = random.Random(i)
        return rng.randbytes(rng.randint(1, 16 * KiB))

    store = BlockStore(StoreConfig(
        dram_capacity=64 * KiB, max_block_bytes=16 * KiB, ssd_path=sys.argv[1], ssd_capacity=16 << 20,
        background_eviction=True,
    ))
    print("ARENA", store.dram.arena.path, flush=True)
    for i in range(40):
        store.put(key(i), value_of(i), depth=i)
    store.evict()
    for i in range(40):
        if store.tier_of(key(i)) == "ssd":
            print("SSD", key(i)[1].hex(), flush=True)
    print("READY", flush=True)
    # Keep working on other keys until killed: puts, overwrites (same bytes per
    # key), removes and reads, with demotions in the background. The reported
    # blocks are never read (a read would promote them out of SSD) and the SSD
    # is large enough that nothing is evicted from it.
    n = 0
    while True:
        i = 1000 + n % 300
        store.put(key(i), value_of(i))
        if n % 7 == 0:
            store.remove(key(1000 + (n + 150) % 300))
        if n % 5 == 0:
            store.get(key(1000 + (n + 100) % 300))
        n += 1
""")


def child_value(i: int) -> bytes:
    rng = random.Random(i)
    return rng.randbytes(rng.randint(1, 16 * KiB))


def read_until_ready(proc: subprocess.Popen, timeout: float) -> list[str]:
    """The child's stdout lines up to READY (fails on EOF or timeout)."""
    lines, buffer = [], b""
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not selector.select(timeout=0.1):
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            buffer += chunk
            *done, buffer = buffer.split(b"\n")
            for line in done:
                text = line.decode()
                if text == "READY":
                    return lines
                lines.append(text)
    finally:
        selector.close()
    raise AssertionError(f"child never got ready; said {lines!r}")


def test_kill_9_keeps_every_block_reported_in_ssd(tmp_path):
    ssd_path = tmp_path / "ssd"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    stderr = open(tmp_path / "child.err", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(ssd_path)], stdout=subprocess.PIPE, stderr=stderr, env=env, cwd=tmp_path
    )
    arena = None
    try:
        try:
            lines = read_until_ready(proc, timeout=30)
        except AssertionError:
            proc.kill()
            proc.wait()
            raise AssertionError((tmp_path / "child.err").read_text()) from None
        arena = next(line.split(" ", 1)[1] for line in lines if line.startswith("ARENA "))
        on_ssd = [int.from_bytes(bytes.fromhex(line.split()[1]), "little") for line in lines if line.startswith("SSD ")]
        assert len(on_ssd) >= 30, lines  # 64 KiB of DRAM holds a handful of the 40 blocks
        time.sleep(0.3)  # let it get well into its later work
        assert proc.poll() is None, (tmp_path / "child.err").read_text()
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        stderr.close()
        if arena is not None and os.path.exists(arena):
            os.unlink(arena)  # a killed process cannot unlink its arena: don't leak /dev/shm

    with open_store(ssd_path, ssd_capacity=16 << 20, ssd_policy="lru") as store:
        for i in on_ssd:
            assert store.tier_of(key(i)) == "ssd", f"block {i}, reported in SSD, is gone"
            assert store.ssd.depth_of(key(i)) == i
        for i in on_ssd:
            assert store.get(key(i)) == child_value(i)
        for k in store.keys():  # whatever else survived holds the bytes it was written with
            assert store.get(k) == child_value(int.from_bytes(k[1], "little"))
        stats = store.stats()
        assert stats["ssd"]["checksum_failures"] == 0
        assert stats["ssd"]["used"] == sum(
            store.size_of(k) for k in store.keys() if store.tier_of(k) == "ssd" or store.describe(k).ssd_copy
        )


# --- (c) a damaged record ----------------------------------------------------------------------------


def flip_payload_byte(ssd_path, payload: bytes) -> None:
    """With the store closed, flip one byte in the middle of the lmdb record whose payload is ``payload``."""
    env = lmdb.open(str(ssd_path), subdir=True, map_size=64 << 20)
    try:
        with env.begin(write=True) as txn:
            matches = [(k, v) for k, v in txn.cursor() if v.endswith(payload)]
            assert len(matches) == 1
            raw_key, value = matches[0]
            damaged = bytearray(value)
            damaged[len(value) - len(payload) // 2] ^= 0xFF
            txn.put(raw_key, bytes(damaged))
    finally:
        env.close()


def test_damaged_record_reads_as_a_miss_and_is_dropped(tmp_path):
    with open_store(tmp_path / "ssd", ssd_capacity=1024 * KiB) as store:
        for i in range(8):
            store.put(key(i), value_of(i))
        for i in range(4):
            store.put(key(100 + i), value_of(100 + i))  # push the first 8 out of DRAM
        assert [store.tier_of(key(i)) for i in range(8)] == ["ssd"] * 8
    flip_payload_byte(tmp_path / "ssd", value_of(2))
    flip_payload_byte(tmp_path / "ssd", value_of(5))

    with open_store(tmp_path / "ssd", ssd_capacity=1024 * KiB) as store:
        assert len(store) == 8 and store.exists(key(2))  # the header is fine: indexed until read
        assert store.get(key(2)) is None
        assert store.stats()["ssd"]["checksum_failures"] == 1
        assert not store.exists(key(2)) and store.tier_of(key(2)) is None

        out = bytearray(16 * KiB)
        assert store.get_into(key(5), out) is None
        assert store.stats()["ssd"]["checksum_failures"] == 2
        assert not store.exists(key(5))

        stats = store.stats()
        assert len(store) == stats["store"]["blocks"] == 6
        assert stats["ssd"]["blocks"] == 6 and stats["ssd"]["used"] == 6 * 16 * KiB
        for i in (0, 1, 3, 4, 6, 7):
            assert store.get(key(i)) == value_of(i)

    with open_store(tmp_path / "ssd", ssd_capacity=1024 * KiB) as store:  # the damaged records were deleted
        assert not store.exists(key(2)) and not store.exists(key(5))
        assert store.stats()["ssd"]["checksum_failures"] == 0
