"""A full disk under the SSD tier: the store evicts from SSD to make room and keeps taking writes.

The disk is a real, small file system: a tmpfs mounted for the test (root with the right to
mount; the test skips elsewhere, saying so). Its SSD tier is configured far larger than the
disk, as when another process fills the disk or the operator over-sized ``--ssd``.
"""

from __future__ import annotations

import os
import random
import subprocess

import pytest

from kvstore.node.config import StoreConfig
from kvstore.node.store import BlockStore

KiB, MiB = 1 << 10, 1 << 20
DISK = 12 * MiB


@pytest.fixture
def small_disk(tmp_path):
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK},mode=0700", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"needs a small tmpfs mounted for the test (root with CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def key(i: int) -> tuple[str, bytes]:
    return ("disk", i.to_bytes(16, "little"))


def value_of(i: int) -> bytes:
    return random.Random(i).randbytes(256 * KiB)


def test_a_full_disk_makes_the_ssd_tier_evict_and_every_put_succeeds(small_disk):
    store = BlockStore(
        StoreConfig(
            dram_capacity=4 * MiB,
            max_block_bytes=256 * KiB,
            ssd_path=str(small_disk / "ssd"),
            ssd_capacity=64 * MiB,  # five times the disk
            background_eviction=False,
        )
    )
    try:
        blocks = 240  # 60 MiB through a 4 MiB DRAM tier onto a 12 MiB disk
        for i in range(blocks):
            store.put(key(i), value_of(i))  # raises if the store refuses a write
        stats = store.stats()["ssd"]
        assert stats["disk_full"] >= 1
        assert stats["capacity"] < 12 * MiB  # the tier holds what the disk holds, and says so
        assert stats["evictions"] > 0
        held = [i for i in range(blocks) if store.exists(key(i))]
        on_ssd = [i for i in held if store.tier_of(key(i)) == "ssd"]
        assert store.exists(key(blocks - 1))
        assert len(on_ssd) * 256 * KiB > 6 * MiB  # the disk is used, not given up on
        assert max(on_ssd) > blocks - 32  # blocks demoted long after the disk filled went to SSD
        for i in held:
            assert store.get(key(i)) == value_of(i)
    finally:
        store.close()


def test_the_tier_takes_its_configured_capacity_back_when_the_disk_frees_up(small_disk, monkeypatch):
    from kvstore.tiers import ssd as ssd_module
    from kvstore.tiers.ssd import SsdTier

    monkeypatch.setattr(ssd_module, "DISK_RECHECK_S", 0.0)
    ballast = small_disk / "ballast"
    ballast.write_bytes(os.urandom(8 * MiB))  # another process's file fills most of the disk
    tier = SsdTier(str(small_disk / "ssd"), 64 * MiB)
    try:
        stored = [tier.put(key(i), value_of(i), 0) for i in range(24)]  # 6 MiB into ~4 MiB free
        assert not all(stored) and tier.disk_full >= 1
        assert tier.disk_limit is not None and tier.capacity_bytes == tier.used_bytes
        ballast.unlink()
        assert tier.put(key(100), value_of(100), 0)  # the recheck found room: writes go on
        assert tier.capacity_bytes > tier.used_bytes
    finally:
        tier.close()
