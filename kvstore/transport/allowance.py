"""A node-wide byte allowance, shared by every connection of a data-plane server.

RESERVE takes its space under the store's cap on grants (``BlockStore.grant``);
what does not fit there may use this allowance instead, one frame's worth
(``max_frame_bytes``) for the whole node, so that a same-host put of a frame
larger than what is left of the cap still goes through, and the space held
for same-host writers between requests stays bounded: the grant cap plus one
frame. Past both, a RESERVE item is SAME_HOST_FULL and the writer sends the
block with PUT instead. See ops.op_reserve.
"""

from __future__ import annotations

import threading


class Allowance:
    """``limit`` bytes, taken and given back by any thread."""

    def __init__(self, limit: int):
        self.limit = limit
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        return self._used

    def take(self, n: int) -> bool:
        """Take ``n`` bytes if they are left; whether they were."""
        with self._lock:
            if self._used + n > self.limit:
                return False
            self._used += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self._used -= n
