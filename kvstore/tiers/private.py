"""Files and directories only this user may open: block data is other tenants' KV cache.

Everything a node creates for its blocks (arena, block directory, SSD files,
Unix socket, data dir) is 0600 in 0700 directories. Same-host SDK clients run
as the node's user, so they still map and connect. Files from older runs,
made with looser modes, are tightened when opened again.
"""

from __future__ import annotations

import os
import stat

from kvstore_client.errors import ConfigError

FILE_MODE, DIR_MODE = 0o600, 0o700


def private_dir(path: str) -> str:
    """Create ``path`` (and parents) if missing, and make it 0700."""
    os.makedirs(path, mode=DIR_MODE, exist_ok=True)
    tighten(path, DIR_MODE)
    return path


def tighten(path: str, mode: int = FILE_MODE) -> None:
    """Take group and other access off ``path`` if it has any (a missing path is fine)."""
    try:
        if os.stat(path).st_mode & 0o077:
            os.chmod(path, mode)
    except FileNotFoundError:
        pass


def own_private_dir(path: str) -> str:
    """``private_dir`` for a directory in a place other users can write (a tmpfs like /dev/shm):
    it must be a real directory of this user, not one another user made first or a link
    they planted (ConfigError, saying what it found)."""
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{path} is not a directory (a link or a file): remove it, or choose another --shm-dir")
    if st.st_uid != os.getuid():
        raise ConfigError(f"{path} belongs to uid {st.st_uid}, not this user: remove it, or choose another --shm-dir")
    tighten(path, DIR_MODE)
    return path
