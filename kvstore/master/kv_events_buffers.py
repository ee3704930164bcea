"""The KV event stream's bounded memory: the change queue and the replay buffer.

``ChangeQueue`` sits between the index (which offers its changes under its lock)
and the publisher thread: offering never blocks and never grows it past
``max_pending`` changes; what does not fit is dropped, counted, and the
publisher is told to resync (see kvstore.master.kv_events). Its ``fileno()``
becomes readable when the publisher should flush early (``wake_at`` changes
waiting, or an overflow), so the publisher waits on it and its ZMQ sockets in
one poll.

``ReplayBuffer`` keeps the last messages published, bounded by count and bytes,
for the replay socket. It is the publisher thread's alone (no lock).
"""

from __future__ import annotations

import collections
import os
import threading
from typing import Iterator


class ChangeQueue:
    """Index changes waiting to become events. Thread-safe; ``offer`` is the index's watch sink."""

    def __init__(self, max_pending: int, wake_at: int):
        self._max, self._wake_at = max_pending, wake_at
        self._lock = threading.Lock()
        self._items: list[tuple[list, bool]] = []
        self._pending = 0
        self._overflowed = False
        self._dropped = 0
        self._signalled = False
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)

    def offer(self, changes: list, emptied: bool) -> None:
        """Queue one index call's changes; on overflow drop everything queued and this too."""
        n = sum(len(diff) for _, diff in changes)
        with self._lock:
            if self._pending + n > self._max:
                self._dropped += self._pending + n
                self._items, self._pending, self._overflowed = [], 0, True
                self._wake()
                return
            self._items.append((changes, emptied))
            self._pending += n
            if self._pending >= self._wake_at:
                self._wake()

    def take(self) -> tuple[list[tuple[list, bool]], bool]:
        """(everything queued, in order; whether changes were dropped before it since the last take)."""
        with self._lock:
            items, overflowed = self._items, self._overflowed
            self._items, self._pending, self._overflowed = [], 0, False
            if self._signalled:
                self._signalled = False
                try:
                    os.read(self._read_fd, 64)
                except BlockingIOError:
                    pass
        return items, overflowed

    def wake(self) -> None:
        """Make ``fileno()`` readable (e.g. to stop the publisher)."""
        with self._lock:
            self._wake()

    def _wake(self) -> None:
        if not self._signalled and self._write_fd >= 0:
            self._signalled = True
            try:
                os.write(self._write_fd, b"\0")
            except BlockingIOError:
                pass

    def fileno(self) -> int:
        """Readable when the publisher should flush now."""
        return self._read_fd

    @property
    def dropped(self) -> int:
        """Changes dropped since start."""
        return self._dropped

    @property
    def pending(self) -> int:
        return self._pending

    def close(self) -> None:
        with self._lock:
            for fd in (self._read_fd, self._write_fd):
                if fd >= 0:
                    os.close(fd)
            self._read_fd = self._write_fd = -1


class ReplayBuffer:
    """The last published messages (seq, topic, payload): at most ``max_messages`` and ``max_bytes``
    of payload (the newest message is kept whatever its size)."""

    def __init__(self, max_messages: int, max_bytes: int):
        self._max_messages, self._max_bytes = max_messages, max_bytes
        self._messages: collections.deque[tuple[int, bytes, bytes]] = collections.deque()
        self._bytes = 0

    def add(self, seq: int, topic: bytes, payload: bytes) -> None:
        self._messages.append((seq, topic, payload))
        self._bytes += len(payload)
        while len(self._messages) > 1 and (len(self._messages) > self._max_messages or self._bytes > self._max_bytes):
            self._bytes -= len(self._messages.popleft()[2])

    def since(self, seq: int) -> Iterator[tuple[int, bytes, bytes]]:
        """The buffered messages numbered ``seq`` or later, oldest first."""
        return (m for m in list(self._messages) if m[0] >= seq)

    def __len__(self) -> int:
        return len(self._messages)

    @property
    def nbytes(self) -> int:
        return self._bytes
