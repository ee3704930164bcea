"""A named shared-memory region that holds the DRAM tier's bytes.

The region is a file under /dev/shm (or $KVSTORE_SHM_DIR), mapped once and
kept for the life of the tier, so a client on the same host can map the same
file by name and copy blocks without a socket in the data path. The creator
unlinks it on close, or at interpreter exit if it was never closed;
``attach`` opens an existing one.

The creator holds an exclusive ``flock`` on the arena file for as long as it
lives (from before the name appears); the kernel drops it when the process
dies, however it dies. So an arena left behind by a killed process is one
whose lock is free, and the next ``create`` removes it (``reap_stale_arenas``),
with its block directory. That holds across PID namespaces: containers that
share /dev/shm see each other's locks, never each other's PIDs, so the pid
in the name (``kvstore-<pid>-<hex>``) says only who made it.
The file is 0600 (``kvstore.tiers.private``): only the node's user maps it.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import secrets
import weakref

from kvstore_client.errors import ConfigError
from kvstore_client.sharedmap import map_shared
from kvstore.tiers.hugepages import HUGE_PAGE, collapse_to_huge_pages
from kvstore.tiers.private import own_private_dir
from kvstore.units import format_size


_ARENA_NAME = re.compile(r"^kvstore-(\d+)-[0-9a-f]+(\.dir)?$")  # an arena, or its block directory


def shm_dir() -> str:
    """Directory that backs shared-memory arenas (tmpfs on Linux)."""
    return os.environ.get("KVSTORE_SHM_DIR") or ("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp")


def node_shm_dir() -> str:
    """This user's directory in ``shm_dir()``, 0700: where nodes put their arenas, block
    directories and Unix sockets, so that no other user's process can open or connect to
    them (other users' clients use TCP). Created on first use."""
    return own_private_dir(os.path.join(shm_dir(), f"kvstore.{os.getuid()}"))


def on_huge_pages(directory: str) -> bool | None:
    """Whether files under ``directory`` get huge pages: a hugetlbfs, or a tmpfs mounted with
    huge=always or huge=within_size. None when /proc/self/mountinfo cannot tell.

    Same-host clients copy blocks out of the arena; on 4 KiB pages that copy runs at about
    0.6-0.8 of memcpy (TLB misses), on 2 MiB pages at memcpy speed.
    """
    try:
        with open("/proc/self/mountinfo") as mounts:
            return huge_pages_in(mounts.read().splitlines(), os.path.realpath(directory))
    except OSError:
        return None


def huge_pages_in(mountinfo: list[str], path: str) -> bool | None:
    """``on_huge_pages`` for an absolute ``path``, from the lines of a mountinfo file."""
    best = None
    for line in mountinfo:
        fields = line.split(" - ")
        if len(fields) != 2:
            continue
        mount_point = fields[0].split()[4]
        fs_type, _, super_options = (fields[1].split() + ["", ""])[:3]
        inside = path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
        if inside and (best is None or len(mount_point) >= len(best[0])):
            best = (mount_point, fs_type, super_options)
    if best is None:
        return None
    _, fs_type, super_options = best
    options = super_options.split(",")
    return fs_type == "hugetlbfs" or (fs_type == "tmpfs" and bool({"huge=always", "huge=within_size"} & set(options)))


class SharedArena:
    """A fixed-size, writable, shared mapping; ``view`` is a memoryview over all of it.

    ``pages`` says what backs it: "huge" (2 MiB pages), "4KiB", "mixed", or "" when
    unknown (an attached arena). Not thread-safe by itself; the owner decides who
    writes which range.
    """

    def __init__(
        self,
        path: str,
        size: int,
        mapping: tuple[mmap.mmap, memoryview],
        owner: bool,
        pages: str = "",
        lock_fd: int | None = None,
    ):
        self.path = path
        self.size = size
        self.name = os.path.basename(path)
        self.pages = pages
        self._mmap, self.view = mapping
        self._owner = owner
        # the creator's: remove the name, then let go of the lock that says the arena is in use
        self._unlink_at_exit = weakref.finalize(self, _remove_and_unlock, path, lock_fd) if owner else None

    @classmethod
    def create(
        cls, size: int, name: str | None = None, prefault: bool = False, huge_pages: bool = True
    ) -> "SharedArena":
        """Create and map a new arena of ``size`` bytes; ``prefault`` touches every page now,
        ``huge_pages`` asks the kernel for 2 MiB pages where the tmpfs would give 4 KiB
        (``kvstore.tiers.hugepages``)."""
        if size <= 0:
            raise ConfigError("arena size must be positive")
        reap_stale_arenas()
        directory = node_shm_dir()
        _check_room(size, directory)
        name = name or f"kvstore-{os.getpid()}-{secrets.token_hex(4)}"
        path = os.path.join(directory, name)
        lock_fd = _create_locked(path)
        try:
            fd = os.open(path, os.O_RDWR)  # mapped by its own name (what /proc/PID/maps then shows)
            try:
                os.ftruncate(fd, size)
                pages = _choose_pages(fd, size, directory, huge_pages)
                _reserve(fd, size, path)
                mapping = map_shared(fd, size, populate=prefault)
            finally:
                os.close(fd)
        except BaseException:
            _remove_and_unlock(path, lock_fd)
            raise
        return cls(path, size, mapping, owner=True, pages=pages, lock_fd=lock_fd)

    @classmethod
    def attach(cls, name: str) -> "SharedArena":
        """Map an existing arena created by another process on this host."""
        path = os.path.join(node_shm_dir(), os.path.basename(name))
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            mapping = map_shared(fd, size)
        finally:
            os.close(fd)
        return cls(path, size, mapping, owner=False)

    def close(self) -> None:
        """Unmap; the creator also removes the name. Views handed out must be released first."""
        if self._mmap is None:
            return
        self.view.release()
        try:
            self._mmap.close()
        except BufferError:  # a caller still holds a view: leave the mapping to the GC
            pass
        self._mmap = None
        if self._unlink_at_exit is not None:
            self._unlink_at_exit()


def _create_locked(path: str) -> int:
    """A new file at ``path`` (FileExistsError if taken), open and exclusively flock'ed before the
    name appears: made under a temporary name, locked, then linked into place, so no reaper ever
    finds it unlocked while its creator lives. The lock lasts as long as the descriptor."""
    directory, name = os.path.split(path)
    temporary = os.path.join(directory, f".{name}.{secrets.token_hex(4)}.new")
    fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a name only we know: free
        except OSError:  # a file system without flock: reapers cannot lock it either, so they keep it
            pass
        os.link(temporary, path)
    except BaseException:
        os.close(fd)
        raise
    finally:
        unlink_quietly(temporary)
    return fd


def _remove_and_unlock(path: str, fd: int | None) -> None:
    unlink_quietly(path)
    if fd is not None:
        os.close(fd)


def _choose_pages(fd: int, size: int, directory: str, huge_pages: bool) -> str:
    """What backs the new, still empty arena ``fd`` in ``directory`` (``SharedArena.pages``):
    the mount's own page size, or, on a 4 KiB tmpfs and with ``huge_pages``, as much of it
    as the kernel would turn into 2 MiB pages."""
    mounted = on_huge_pages(directory)
    if mounted or not huge_pages:
        return {True: "huge", False: "4KiB", None: ""}[mounted]
    huge = collapse_to_huge_pages(fd, size)
    if huge == 0:
        return "4KiB" if mounted is False else ""
    return "huge" if huge == size - size % HUGE_PAGE else "mixed"


def _check_room(size: int, directory: str) -> None:
    """Refuse an arena that ``directory`` or this machine's memory cannot hold before taking
    any of it: a fallocate of too much fills the tmpfs, and the host's memory, on its way to
    failing, so other processes get SIGBUS or the OOM killer meanwhile."""
    fs = os.statvfs(directory)
    free = fs.f_bavail * fs.f_frsize
    if size > free:
        raise ConfigError(
            f"cannot reserve {format_size(size)} of shared memory in {directory} "
            f"({format_size(free)} free); lower the DRAM tier or enlarge the tmpfs (docker: --shm-size)"
        )
    available = memory_available() if fs.f_frsize <= mmap.PAGESIZE else None  # hugetlbfs: a pool of its own
    if available is not None and size > available:
        raise ConfigError(
            f"cannot reserve {format_size(size)} of shared memory: this machine has "
            f"{format_size(available)} of memory available (MemAvailable); lower the DRAM tier"
        )


def memory_available() -> int | None:
    """Bytes of memory the kernel could give without swapping (MemAvailable), None if unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _reserve(fd: int, size: int, path: str) -> None:
    """Back the whole arena with memory now, so a full /dev/shm is a clear error at
    start-up rather than a SIGBUS on some later write (``_check_room`` catches the usual
    case first; this one, another process filling the tmpfs in between)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        free = os.statvfs(os.path.dirname(path))
        raise ConfigError(
            f"cannot reserve {size} bytes of shared memory in {os.path.dirname(path)} "
            f"({free.f_bavail * free.f_frsize} free): {exc.strerror}; lower the DRAM tier or enlarge the tmpfs "
            "(docker: --shm-size)"
        ) from None


def unlink_quietly(path: str) -> None:
    """Remove ``path``; one already gone is fine."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` names a live process in this PID namespace (a pid of another one may not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def reap_stale_arenas() -> list[str]:
    """Remove default-named arenas whose creator is gone, provably: nothing holds the arena's lock
    (``SharedArena.create``), whatever PID namespace the creator ran in; and the block directories
    of those, and of arenas no longer there. The names removed.

    An arena named for a pid that lives here is kept even with its lock free: it may come from a
    kvstore that did not lock arenas yet (so is still in use), or the pid has been reused (a leak
    until that process ends, as before). A free lock alone is proof only for arenas made since."""
    removed = []
    for directory in (node_shm_dir(), shm_dir()):  # and arenas of versions that made them in shm_dir()
        removed += _reap_in(directory)
    return removed


def _reap_in(directory: str) -> list[str]:
    removed = []
    entries = sorted(os.listdir(directory), key=lambda e: e.endswith(".dir"))  # arenas first
    for entry in entries:
        match = _ARENA_NAME.match(entry)
        if match is None:
            continue
        path = os.path.join(directory, entry)
        arena = path[: -len(".dir")] if match.group(2) else path
        if _pid_alive(int(match.group(1))):
            continue  # perhaps made before arenas were locked, by a process that lives: keep
        if _remove_if_unlocked(arena, also=path if arena != path else None):
            removed.append(entry)
    return removed


def _remove_if_unlocked(arena: str, also: str | None = None) -> bool:
    """Remove ``also`` (``arena`` itself when None) if nothing holds the arena's lock, or (for
    ``also``) the arena is gone already; whether it removed it."""
    try:
        fd = os.open(arena, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:  # the arena went first (or was reaped just now): its directory is an orphan
        return also is not None and _unlink_if_present(also)
    except OSError:  # not ours to open: keep
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held (BlockingIOError): its creator lives; or no flock here: cannot tell, keep
            return False
        try:
            if not os.path.samestat(os.fstat(fd), os.stat(arena)):
                return False  # a new arena by that name meanwhile: not the file we locked
        except FileNotFoundError:
            pass  # removed meanwhile
        return _unlink_if_present(also or arena)
    finally:
        os.close(fd)  # and with it our lock


def _unlink_if_present(path: str) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True
