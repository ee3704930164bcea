"""Shared-memory arenas: mapped by name from another process, never leaked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from kvstore.tiers.arena import SharedArena, huge_pages_in, reap_stale_arenas, shm_dir

CHILD = """
import sys, time
from kvstore.tiers.arena import SharedArena
arena = SharedArena.create(1 << 20)
arena.view[:5] = b"hello"
print(arena.path, flush=True)
if sys.argv[1] == "hang":
    time.sleep(60)
"""


def spawn(mode: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, mode], stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def test_attach_sees_the_creators_bytes():
    arena = SharedArena.create(1 << 20)
    try:
        arena.view[100:105] = b"abcde"
        other = SharedArena.attach(arena.name)
        assert bytes(other.view[100:105]) == b"abcde" and other.size == arena.size
        other.close()
        assert os.path.exists(arena.path)  # attaching side never removes it
    finally:
        arena.close()
    assert not os.path.exists(arena.path)


def test_unclosed_arena_is_removed_at_exit():
    proc, path = spawn("exit")
    proc.wait(timeout=30)
    assert path.startswith(shm_dir()) and not os.path.exists(path)


def test_arena_of_a_killed_process_is_reaped():
    proc, path = spawn("hang")
    try:
        assert os.path.exists(path)
        assert os.path.basename(path) not in reap_stale_arenas()  # creator alive: kept
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert os.path.exists(path)
        assert os.path.basename(path) in reap_stale_arenas()
        assert not os.path.exists(path)
    finally:
        proc.kill()
        proc.stdout.close()


def test_arena_larger_than_shared_memory_is_a_clear_error():
    import pytest

    from kvstore_client.errors import ConfigError

    stat = os.statvfs(shm_dir())
    too_big = stat.f_bavail * stat.f_frsize + (1 << 30)
    before = set(os.listdir(shm_dir()))
    with pytest.raises(ConfigError, match="shared memory"):
        SharedArena.create(too_big)
    assert set(os.listdir(shm_dir())) <= before  # nothing left behind


def test_arena_larger_than_available_memory_is_refused_before_any_is_taken():
    import pytest

    from kvstore.tiers.arena import memory_available
    from kvstore_client.errors import ConfigError

    available = memory_available()
    if available is None:
        pytest.skip("no /proc/meminfo here")
    before = set(os.listdir(shm_dir()))
    with pytest.raises(ConfigError, match="shared memory"):
        SharedArena.create(available + (1 << 30))
    assert set(os.listdir(shm_dir())) <= before


MOUNTINFO = [
    "22 1 0:21 / / rw,relatime - overlay overlay rw,lowerdir=/a",
    "30 22 0:26 / /dev/shm rw,nosuid,nodev - tmpfs shm rw,size=65536k",
    "31 22 0:27 / /mnt/huge rw,relatime - tmpfs kvhuge rw,size=8388608k,huge=within_size",
    "32 22 0:28 / /mnt/huge/advise rw,relatime - tmpfs kvadvise rw,huge=advise",
    "33 22 0:29 / /mnt/tlb rw,relatime - hugetlbfs hugetlbfs rw,pagesize=2M",
]


@pytest.mark.parametrize("path, expected", [
    ("/dev/shm", False), ("/dev/shm/kvstore", False), ("/mnt/huge", True), ("/mnt/huge/arenas", True),
    ("/mnt/huge/advise", False), ("/mnt/hugepages", False), ("/mnt/tlb/x", True), ("/tmp", False),
])
def test_huge_pages_come_from_the_innermost_mount(path, expected):
    assert huge_pages_in(MOUNTINFO, path) is expected


def test_no_mount_table_means_unknown():
    assert huge_pages_in([], "/dev/shm") is None

