"""The arena space one data-plane connection holds for its writer: reservation groups by id.

A RESERVE makes a group (one reservation per item), kept until COMMIT publishes or aborts
it, or the connection ends. A writer may fill a group slowly (the vLLM connector writes a
block's slices layer by layer, as the model computes them), but not forever: a keyed group
older than the node's ``write_ttl`` is revoked by the server's housekeeping thread, and the
COMMIT that comes too late is answered EXPIRED for each item. Grants (space bound to no
key yet, for a same-host writer's next put) belong to the connection as long as it lives
and never expire.

Thread-safety: the connection's thread adds and pops groups, the housekeeping thread expires
them; ``_lock`` guards the tables and is held only for dict operations. A group is taken out
under the lock by exactly one of them, which then ends it (``ops.end_group``).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

EXPIRED = object()  # what ``pop`` returns for a group the housekeeping thread revoked
_EXPIRED_REMEMBERED = 4096  # ids of expired groups a connection still answers EXPIRED for


class ReservationTable:
    """Reservation groups by id: keyed ones in age order (they expire), grants apart."""

    def __init__(self) -> None:
        self._keyed: OrderedDict[int, tuple[float, list]] = OrderedDict()  # id -> (monotonic time taken, group)
        self._grants: dict[int, list] = {}
        self._expired: OrderedDict[int, None] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._keyed) + len(self._grants)

    def add(self, group_id: int, group: list, grant: bool) -> None:
        with self._lock:
            if grant:
                self._grants[group_id] = group
            else:
                self._keyed[group_id] = (time.monotonic(), group)

    def pop(self, group_id: int):
        """The group ``group_id``, taken out; EXPIRED if it outlived the TTL; None if unknown."""
        with self._lock:
            entry = self._keyed.pop(group_id, None)
            if entry is not None:
                return entry[1]
            group = self._grants.pop(group_id, None)
            if group is not None:
                return group
            return EXPIRED if self._expired.pop(group_id, False) is None else None

    def expire(self, cutoff: float) -> list[list]:
        """Take out the keyed groups made at or before ``cutoff`` (monotonic): the caller ends them."""
        with self._lock:
            old = []
            for group_id, (taken, _) in self._keyed.items():  # insertion order is age order
                if taken > cutoff:
                    break
                old.append(group_id)
            groups = [self._keyed.pop(group_id)[1] for group_id in old]
            for group_id in old:
                self._expired[group_id] = None
            while len(self._expired) > _EXPIRED_REMEMBERED:
                self._expired.popitem(last=False)
        return groups

    def drain(self) -> list[list]:
        """Every group still held, taken out (the connection is ending)."""
        with self._lock:
            groups = [group for _, group in self._keyed.values()] + list(self._grants.values())
            self._keyed.clear()
            self._grants.clear()
            self._expired.clear()
        return groups
