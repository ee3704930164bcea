"""Where a client's puts go: one answer from the master serves many puts.

A placement (the nodes for a namespace's puts, primary first) is good for
``ttl`` seconds or its size in bytes of puts, whichever ends first; the master
counts those bytes against the chosen nodes until their next heartbeat, so
concurrent writers spread over the pool. The next placement is asked for in
the background once half of the current one is used up, or half its time (a
master round trip is 0.5-1.5 ms: a 1 MiB put waiting for it would take 3-4
times longer).

Its size follows the writer: the bytes it would put in ``ttl`` seconds at the
rate it is using the current placement, at least ``min_bytes`` and at most
``GROWTH`` times that. A writer putting gigabytes a second then asks the
master a few dozen times a second instead of hundreds, which costs both the
client and the master CPU the puts need (15-20 microseconds per 1 MiB put on
2 cores), while a slow writer still holds only ``min_bytes`` of the pool's
free-space budget.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

import grpc

from kvstore_client.errors import ServiceUnavailable

GROWTH = 16  # a placement grows to at most this many times min_bytes for a fast writer


@dataclass
class _Held:
    nodes: list
    until: float  # monotonic time it expires
    left: int  # bytes of puts it still covers
    since: float  # when it was received
    size: int  # bytes it covered at first


class Placements:
    """Per-namespace placements, reused and renewed ahead. Thread-safe.

    ``ask(namespace, nbytes)`` asks the master now (a PlaceReply, or a typed
    error); ``ask_ahead(namespace, nbytes)`` asks in the background (a
    future of one); ``on_nodes(nodes)`` learns the nodes of every reply.
    ``growth``: a fast writer's placements grow to at most this many times ``min_bytes``.
    """

    def __init__(
        self, ask: Callable, ask_ahead: Callable, on_nodes: Callable, ttl: float, min_bytes: int, growth: int = GROWTH
    ):
        self._ask, self._ask_ahead, self._on_nodes = ask, ask_ahead, on_nodes
        self.ttl, self.min_bytes, self.growth = ttl, min_bytes, growth
        self._held: dict[str, _Held] = {}
        self._ahead: dict[str, tuple[float, int, grpc.Future]] = {}  # (asked at, size, reply to come)
        self._lock = threading.Lock()

    def nodes_for(self, namespace: str, nbytes: int) -> list:
        """The nodes for a put of ``nbytes`` to ``namespace``, primary first."""
        now = time.monotonic()
        with self._lock:
            held = self._held.get(namespace)
            if held is not None and held.until > now and held.left >= nbytes:
                held.left -= nbytes
                if namespace not in self._ahead and (held.left < held.size // 2 or held.until - now < self.ttl / 2):
                    size = self.next_size(held.size - held.left, now - held.since)
                    self._ahead[namespace] = (now, size, self._ask_ahead(namespace, size))
                return held.nodes
            asked_at, size, ahead = self._ahead.pop(namespace, (0.0, 0, None))
        reply = None
        if ahead is not None and size >= nbytes and now - asked_at < self.ttl:
            try:
                reply = ahead.result()
            except grpc.RpcError:
                pass  # asked again below, which raises the typed error
        if reply is None:
            size = max(nbytes, self.min_bytes)
            if nbytes > self.min_bytes:  # a put larger than a placement: room for one more like it, within the cap
                size = max(nbytes, min(2 * nbytes, self.growth * self.min_bytes))
            reply = self._ask(namespace, size)
        if not reply.nodes:
            raise ServiceUnavailable("the master knows no live storage node to put blocks on")
        nodes = list(reply.nodes)
        self._on_nodes(nodes)
        with self._lock:
            self._held[namespace] = _Held(nodes, now + self.ttl, size - nbytes, now, size)
        return nodes

    def next_size(self, used: int, elapsed: float) -> int:
        """Bytes for the next placement of a writer that used ``used`` bytes in ``elapsed`` seconds."""
        wanted = int(used / max(elapsed, 1e-3) * self.ttl)
        return min(max(wanted, self.min_bytes), self.growth * self.min_bytes)

    def asked_ahead(self, namespace: str) -> tuple[int, grpc.Future] | None:
        """(size, future) of the placement asked for ahead for ``namespace``, if any."""
        with self._lock:
            ahead = self._ahead.get(namespace)
        return None if ahead is None else ahead[1:]

    def clear(self) -> None:
        """Forget every placement (one may name a node just found dead)."""
        with self._lock:
            self._held.clear()
            self._ahead.clear()
