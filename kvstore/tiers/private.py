"""Files and directories only this user may open: block data is other tenants' KV cache.

Everything a node creates for its blocks (arena, block directory, SSD files,
Unix socket, data dir) is 0600 in 0700 directories. Same-host SDK clients run
as the node's user, so they still map and connect. Files from older runs,
made with looser modes, are tightened when opened again.
"""

from __future__ import annotations

import os

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
