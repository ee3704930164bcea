"""One process per data dir: an exclusive flock on ``<data dir>/lock`` for the process's life.

Two nodes on one data dir would share an lmdb environment and a node id, and
the second's registration would take the first one's blocks out of the index.
The lock is an ``fcntl.flock`` on a file that records the holder's pid; the
kernel drops it when the holder exits, however it exits, so a lock left by a
killed node is never stale. The file is not removed on release (removing it
would let two processes each lock a different file of the same name).
"""

from __future__ import annotations

import fcntl
import os

from kvstore_client.errors import ConfigError
from kvstore.tiers.private import private_dir

LOCK_NAME = "lock"


class DataDirInUse(ConfigError):
    """Another live process holds this data dir."""


class DataDirLock:
    """Held from ``acquire`` until ``release`` (or process exit)."""

    def __init__(self, data_dir: str):
        self.data_dir = data_dir
        self.path = os.path.join(data_dir, LOCK_NAME)
        self._fd: int | None = None

    def acquire(self) -> "DataDirLock":
        """Take the lock and write this pid; DataDirInUse naming the holder if it is taken."""
        private_dir(self.data_dir)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DataDirInUse(
                f"data dir {self.data_dir} is in use by another kvstore process (pid {holder}, "
                f"lock file {self.path}); stop it first or use another --data-dir"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the only descriptor drops the flock
