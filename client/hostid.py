"""Which machine this is, so a client can tell that a node shares its memory."""

from __future__ import annotations

import functools
import socket


@functools.cache
def machine_id() -> str:
    """A stable id of this host: /etc/machine-id (or D-Bus's copy), else the boot id, else the host name.

    Two processes see the same value exactly when they can map the same
    /dev/shm files, which is what the shared-memory data path needs.
    """
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id", "/proc/sys/kernel/random/boot_id"):
        try:
            with open(path) as f:
                value = f.read().strip()
        except OSError:
            continue
        if value:
            return value
    return socket.gethostname()
