"""Shared-memory arenas: mapped by name from another process, never leaked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from kvstore.tiers.arena import SharedArena, huge_pages_in, node_shm_dir, reap_stale_arenas, shm_dir

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


OWNER = """
import os, sys, time
from kvstore.tiers.arena import SharedArena
arena = SharedArena.create(1 << 20, name=sys.argv[1] or None)
open(arena.path + ".dir", "w").close()  # its block directory, as a node's DRAM tier makes one
print(arena.path, flush=True)
sys.stdin.read()  # until the test closes it; then die as if killed: no clean-up, the kernel drops the lock
os._exit(1)
"""


def invisible_pid() -> int:
    """A pid no process here can have (past pid_max): what a creator in another PID namespace looks like."""
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read()) + 1


def spawn_owner(name: str = "", prefix: list[str] = ()) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-c", OWNER, name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    return proc, proc.stdout.readline().strip()


def stop(proc: subprocess.Popen) -> None:
    """End the owner abruptly and wait for it (and for whatever runs it: unshare waits for its child)."""
    proc.stdin.close()
    proc.wait(timeout=60)
    proc.stdout.close()


def clean_up(proc: subprocess.Popen, path: str) -> None:
    """After a test, whatever it asserted: the owner gone, its arena and directory removed."""
    if proc.poll() is None:
        proc.kill()
        stop(proc)
    for leftover in (path, path + ".dir"):
        if leftover and os.path.exists(leftover):
            os.unlink(leftover)


def test_a_live_arena_whose_owner_pid_is_not_visible_here_is_kept():
    """Containers sharing /dev/shm: the name's pid means nothing here; the creator's lock shows it lives."""
    proc, path = spawn_owner(f"kvstore-{invisible_pid()}-{os.urandom(4).hex()}")
    try:
        assert os.path.exists(path)
        removed = reap_stale_arenas()
        assert os.path.basename(path) not in removed and os.path.basename(path) + ".dir" not in removed
        assert os.path.exists(path) and os.path.exists(path + ".dir")
        stop(proc)  # the kernel lets go of its lock: now provably stale
        assert set(reap_stale_arenas()) >= {os.path.basename(path), os.path.basename(path) + ".dir"}
        assert not os.path.exists(path) and not os.path.exists(path + ".dir")
    finally:
        clean_up(proc, path)


def test_an_arena_nobody_holds_is_reaped():
    """No lock held, and the pid in the name is no process here (dead, or of another namespace): reaped."""
    stale = os.path.join(shm_dir(), f"kvstore-{invisible_pid()}-{os.urandom(4).hex()}")
    orphan = os.path.join(shm_dir(), f"kvstore-{invisible_pid()}-{os.urandom(4).hex()}.dir")  # no arena left
    for path in (stale, stale + ".dir", orphan):
        open(path, "w").close()
    removed = reap_stale_arenas()
    assert {os.path.basename(p) for p in (stale, stale + ".dir", orphan)} <= set(removed)
    assert not any(os.path.exists(p) for p in (stale, stale + ".dir", orphan))


def test_an_unlocked_arena_named_for_a_live_pid_here_is_kept():
    """What a kvstore from before arenas were locked leaves while it runs: not provably stale."""
    legacy = os.path.join(shm_dir(), f"kvstore-{os.getpid()}-{os.urandom(4).hex()}")
    open(legacy, "w").close()
    try:
        assert os.path.basename(legacy) not in reap_stale_arenas() and os.path.exists(legacy)
    finally:
        os.unlink(legacy)


def _unshare_pid() -> list[str] | None:
    prefix = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--"]
    try:
        ok = subprocess.run(prefix + ["true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return prefix if ok else None


def test_an_arena_made_in_another_pid_namespace_is_kept_while_its_creator_lives():
    """The real thing where this machine allows it (root, util-linux): the creator runs in a PID namespace
    of its own, with a pid that names no process here."""
    prefix = _unshare_pid()
    if prefix is None:
        pytest.skip("cannot make a PID namespace here (unshare)")
    pid = next(p for p in range(invisible_pid() // 2, invisible_pid()) if not os.path.exists(f"/proc/{p}"))
    shell = ["sh", "-c", f'echo {pid - 1} > /proc/sys/kernel/ns_last_pid; "$@"', "sh"]  # the next fork: pid
    proc, path = spawn_owner("", prefix + shell)
    try:
        owner = int(os.path.basename(path).split("-")[1])
        assert not os.path.exists(f"/proc/{owner}"), "the pid namespace's pid is visible here"
        assert os.path.basename(path) not in reap_stale_arenas()
        assert os.path.exists(path) and os.path.exists(path + ".dir")
        stop(proc)
        assert os.path.basename(path) in reap_stale_arenas() and not os.path.exists(path + ".dir")
    finally:
        clean_up(proc, path)


def test_a_new_arena_is_locked_from_the_moment_its_name_appears(tmp_path, monkeypatch):
    import fcntl

    monkeypatch.setenv("KVSTORE_SHM_DIR", str(tmp_path))
    arena = SharedArena.create(1 << 20)
    try:
        fd = os.open(arena.path, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        assert os.listdir(tmp_path) == [os.path.basename(node_shm_dir())]  # this user's directory, 0700
        assert os.stat(node_shm_dir()).st_mode & 0o777 == 0o700
        assert os.listdir(node_shm_dir()) == [arena.name]  # no temporary name left behind
    finally:
        arena.close()
    assert os.listdir(node_shm_dir()) == []


def test_arena_larger_than_shared_memory_is_a_clear_error():
    import pytest

    from kvstore_client.errors import ConfigError

    stat = os.statvfs(shm_dir())
    too_big = stat.f_bavail * stat.f_frsize + (1 << 30)
    before = set(os.listdir(node_shm_dir()))
    with pytest.raises(ConfigError, match="shared memory"):
        SharedArena.create(too_big)
    assert set(os.listdir(node_shm_dir())) <= before  # nothing left behind


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


@pytest.mark.parametrize(
    "path, expected",
    [
        ("/dev/shm", False),
        ("/dev/shm/kvstore", False),
        ("/mnt/huge", True),
        ("/mnt/huge/arenas", True),
        ("/mnt/huge/advise", False),
        ("/mnt/hugepages", False),
        ("/mnt/tlb/x", True),
        ("/tmp", False),
    ],
)
def test_huge_pages_come_from_the_innermost_mount(path, expected):
    assert huge_pages_in(MOUNTINFO, path) is expected


def test_no_mount_table_means_unknown():
    assert huge_pages_in([], "/dev/shm") is None


# -- huge pages on a 4 KiB tmpfs (kvstore.tiers.hugepages) -------------------------------------


def pmd_mapped_bytes(path: str, pid: int | str = "self") -> int:
    """Bytes of ``path`` that process ``pid`` maps with 2 MiB page-table entries (kernel's word:
    only a huge page can be mapped so)."""
    total, current = 0, None
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                current = fields[5] if len(fields) > 5 else ""
            elif fields[0] == "ShmemPmdMapped:" and current == path:
                total += int(fields[1]) * 1024
    return total


def collapse_supported() -> bool:
    """Linux >= 6.1 with shmem THP not denied, and arenas on a 4 KiB tmpfs."""
    from kvstore.tiers.arena import on_huge_pages

    release = os.uname().release.split(".")
    try:
        new_enough = (int(release[0]), int(release[1].split("-")[0])) >= (6, 1)
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as knob:
            denied = "[deny]" in knob.read()
    except (ValueError, IndexError, OSError):
        return False
    return sys.platform.startswith("linux") and new_enough and not denied and on_huge_pages(shm_dir()) is False


needs_collapse = pytest.mark.skipif(not collapse_supported(), reason="needs Linux >= 6.1 and arenas on a 4 KiB tmpfs")


@needs_collapse
def test_an_arena_on_a_4k_tmpfs_gets_huge_pages_for_every_mapping():
    arena = SharedArena.create(8 << 20)
    other = None
    try:
        assert arena.pages == "huge"
        arena.view[:] = bytes(range(256)) * (len(arena.view) // 256)  # fault every page in
        assert pmd_mapped_bytes(arena.path) == 8 << 20
        other = SharedArena.attach(arena.name)  # a second, independent mapping of the same file
        assert bytes(other.view) == bytes(arena.view)  # reads every page
        assert pmd_mapped_bytes(arena.path) == 16 << 20
    finally:
        if other is not None:
            other.close()
        arena.close()


@needs_collapse
def test_huge_pages_cover_whole_2mib_chunks_and_can_be_declined():
    odd = SharedArena.create(5 << 20)  # two whole chunks and a 1 MiB tail on 4 KiB pages
    plain = SharedArena.create(4 << 20, huge_pages=False)
    try:
        assert odd.pages == "huge" and plain.pages == "4KiB"
        odd.view[:] = b"\x5a" * len(odd.view)
        plain.view[:] = b"\xa5" * len(plain.view)
        assert pmd_mapped_bytes(odd.path) == 4 << 20
        assert pmd_mapped_bytes(plain.path) == 0
        assert bytes(odd.view[-2:]) == b"\x5a\x5a" and bytes(plain.view[-2:]) == b"\xa5\xa5"
    finally:
        odd.close()
        plain.close()


def test_shared_mappings_are_2mib_aligned_and_refuse_to_close_under_a_view(tmp_path):
    import ctypes

    from kvstore_client.sharedmap import HUGE_PAGE, map_shared

    path = tmp_path / "file"
    path.write_bytes(b"x" * (3 << 20))
    fd = os.open(path, os.O_RDWR)
    try:
        owner, view = map_shared(fd, 3 << 20)
    finally:
        os.close(fd)
    assert len(view) == 3 << 20 and bytes(view[-1:]) == b"x"
    address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    assert address % HUGE_PAGE == 0
    held = view[10:20]
    view.release()
    with pytest.raises(BufferError):
        owner.close()  # a slice still points into it: unmapping now would leave it dangling
    held.release()
    owner.close()
    assert owner.closed


@needs_collapse
def test_huge_pages_stop_at_their_time_budget_and_the_rest_stays_4k():
    from kvstore.tiers.hugepages import collapse_to_huge_pages
    from kvstore_client.sharedmap import map_shared

    path = os.path.join(shm_dir(), f"kvstore-budget-test-{os.getpid()}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 12 << 20)
        # sections of 4 MiB and no time at all: the first section is made, no other is started
        assert collapse_to_huge_pages(fd, 12 << 20, budget_s=0.0, section_chunks=2) == 4 << 20
        owner, view = map_shared(fd, 12 << 20)
        view[:] = b"\x01" * len(view)
        assert pmd_mapped_bytes(path) == 4 << 20
        view.release()
        owner.close()
    finally:
        os.close(fd)
        os.unlink(path)


def test_a_directory_another_user_planted_in_the_shm_dir_is_refused(tmp_path, monkeypatch):
    import pytest

    from kvstore_client.errors import ConfigError

    if os.getuid() != 0:
        pytest.skip("needs root to make a directory of another user")
    monkeypatch.setenv("KVSTORE_SHM_DIR", str(tmp_path))
    planted = tmp_path / f"kvstore.{os.getuid()}"
    planted.mkdir(mode=0o777)
    os.chown(planted, 65534, 65534)  # made first by someone else, to read what lands in it
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        SharedArena.create(1 << 20)
    planted.rmdir()
    planted.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match="not a directory"):
        SharedArena.create(1 << 20)
