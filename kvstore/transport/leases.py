"""The read leases one data-plane connection holds for a same-host client.

A LEASE request pins its DRAM blocks as one group under one lease id. Groups
end when the client releases them (a RELEASE frame, which the SDK sends late:
together with its next request), when the connection ends, or, so that an
idle client cannot pin blocks forever, when the server's housekeeping thread finds them
older than the lease TTL. Groups taken with FLAG_HOLD (zero-copy views a
caller keeps) never expire.

Thread-safety: the connection's thread adds and pops groups, the server's
housekeeping thread expires them; ``_lock`` guards both tables and is held only for
dict operations, never while calling the store: groups are taken out under
the lock and released (store locks) after it is dropped.
"""

from __future__ import annotations

import threading
import time


def release_groups(groups: list) -> None:
    """Release every store Lease of every group."""
    for group in groups:
        for lease in group:
            lease.release()


class LeaseTable:
    """Lease groups by id: expiring ones in age order, held ones apart."""

    def __init__(self) -> None:
        self._expiring: dict[int, tuple[float, list]] = {}  # id -> (monotonic time taken, leases); oldest first
        self._held: dict[int, list] = {}  # id -> leases, until released or the connection ends
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._expiring) + len(self._held)

    @property
    def held(self) -> bool:
        """Whether any group taken with HOLD is still held (such a reader may idle on)."""
        return bool(self._held)

    def add(self, lease_id: int, group: list, hold: bool = False) -> None:
        with self._lock:
            if hold:
                self._held[lease_id] = group
            else:
                self._expiring[lease_id] = (time.monotonic(), group)

    def pop(self, ids) -> tuple[list, list[int]]:
        """Take the groups of ``ids`` out: (groups, ids not held). The caller releases the groups."""
        groups, missing = [], []
        with self._lock:
            for lease_id in ids:
                entry = self._expiring.pop(lease_id, None)
                if entry is not None:
                    groups.append(entry[1])
                    continue
                group = self._held.pop(lease_id, None)
                if group is None:
                    missing.append(lease_id)
                else:
                    groups.append(group)
        return groups, missing

    def expire(self, cutoff: float) -> int:
        """Release the expiring groups taken at or before ``cutoff`` (monotonic); how many."""
        with self._lock:
            old = []
            for lease_id, (taken, _) in self._expiring.items():  # insertion order is age order
                if taken > cutoff:
                    break
                old.append(lease_id)
            groups = [self._expiring.pop(lease_id)[1] for lease_id in old]
        release_groups(groups)
        return len(groups)

    def release_all(self) -> None:
        with self._lock:
            groups = [group for _, group in self._expiring.values()] + list(self._held.values())
            self._expiring, self._held = {}, {}
        release_groups(groups)
