"""The KV event publisher: one thread that turns index changes into vLLM KVEventBatch messages on ZMQ.

    publisher = KVEventsPublisher(KVEventsOptions("tcp://*:5557", "tcp://*:5558"), index).start()
    publisher.endpoint, publisher.replay_endpoint   # as bound ("tcp://0.0.0.0:5557", ...)
    publisher.stop()

What is published, and why, is kvstore.master.kv_events's business; this is the
mechanism. ``start`` binds the PUB (and replay ROUTER) socket, raising
ConfigError if it cannot, and watches the index (its changes go to a bounded
ChangeQueue). The thread "master-kv-events" owns both sockets: it waits on the
queue's wake-up descriptor and the ROUTER in one poll, flushes every
``flush_interval_s`` (or sooner when ``max_block_hashes`` changes wait), and
serves replay requests from a ReplayBuffer. Its first flush is a resync
(AllBlocksCleared, then whatever the index already holds), as is the first
after changes were dropped.

With an access file both sockets speak ZMQ's PLAIN mechanism: a subscriber
(or replay requester) sets ``plain_username`` (any) and ``plain_password`` (an
admin token) on its socket, and the same thread answers ZAP, ZMQ's
authentication requests, from the access file: the feed names every tenant's
blocks, so only admins read it; anyone else's connection fails its handshake
and receives nothing. Replays are paced: at most ``replay_rate`` messages a
second for all requesters together (one whole buffer at once); a request past
that budget gets the end marker at once, to ask again later. When the access
file is reloaded (``reauthenticate``) the thread closes both sockets and binds
them again on the same addresses: ZMQ subscribers reconnect by themselves, and
each handshake is checked against the tokens now in force, so a revoked token's
subscriber is cut off (subscribers may replay what they missed meanwhile). Imports pyzmq and msgspec: load it only when
KV events are on (kv_events.open_publisher does).
"""

from __future__ import annotations

import logging
import threading
import time

import zmq

from kvstore.master.index import NO_HOLDERS, PrefixIndex
from kvstore.master.kv_events import (
    CLEAR,
    CLEARED,
    REMOVED,
    STORED,
    Event,
    KVEventsOptions,
    append_events,
    events_for,
    split_events,
)
from kvstore.master.kv_events_buffers import ChangeQueue, ReplayBuffer
from kvstore.master.kv_events_wire import Encoder
from kvstore.metrics import Sample
from kvstore.security.access import ADMIN
from kvstore_client.errors import ConfigError

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's end-of-replay marker
_SNAPSHOT_PAGE = 4096
_REPLAYS_PER_WAKE = 16  # replay requests served between flushes
_LINGER_MS = 500  # at close, how long queued messages may still go out
_MAX_ANNOUNCED = 100_000  # namespaces remembered for the per-namespace clears of a resync
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks its context's authenticator
ZAP_DOMAIN = "kvstore-kv-events"


def _bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind ``endpoint``; the address actually bound (port 0 resolved)."""
    if endpoint.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    sock.bind(endpoint)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class KVEventsPublisher:
    """Publishes a PrefixIndex's changes as vLLM KV events (see the module doc). Thread-safe."""

    def __init__(self, options: KVEventsOptions, index: PrefixIndex, access=None):
        self._options = options
        self._index = index
        self._access = access  # an AccessList: subscribers present an admin token (None: anyone on the endpoint)
        self._zap: zmq.Socket | None = None
        self._replay_tokens = float(options.replay_messages)  # the replay budget: a whole buffer at once
        self._replay_refilled = time.monotonic()
        self._queue = ChangeQueue(options.max_pending, wake_at=options.max_block_hashes)
        self._buffer = ReplayBuffer(options.replay_messages, options.replay_bytes)
        self._encoder = Encoder(options.hashes)
        self._prefix = options.topic.encode()
        self._ctx: zmq.Context | None = None
        self._pub: zmq.Socket | None = None
        self._router: zmq.Socket | None = None
        self.endpoint: str | None = None
        self.replay_endpoint: str | None = None
        self._seq = 0
        self._resync_due = True  # the first flush announces AllBlocksCleared and what the index holds
        self._announced: set[str] = set()  # namespaces with blocks stored since the last resync or emptying
        self._announced_full = False  # said once that _announced reached its bound
        self._stopping = threading.Event()
        self._rebind_due = False  # set by reauthenticate(), done by the thread
        self._thread: threading.Thread | None = None
        # counters: written by the publisher thread only, read by metrics scrapes
        self._messages = 0
        self._events = {STORED: 0, REMOVED: 0, CLEARED: 0}
        self._blocks = {STORED: 0, REMOVED: 0}
        self._resyncs = 0
        self._replay_requests = 0
        self._replay_deferred = 0
        self._bad_requests = 0
        self._refused_subscribers = 0

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> KVEventsPublisher:
        """Bind the sockets (ConfigError if one cannot be bound), watch the index, start the thread."""
        options = self._options
        self._ctx = zmq.Context()
        what = "--kv-events"
        try:
            if self._access is not None:  # bound first: no connection gets in before it answers
                self._zap = self._ctx.socket(zmq.REP)
                self._zap.setsockopt(zmq.LINGER, 0)
                self._zap.bind(ZAP_ENDPOINT)
            self._pub = self._publisher_socket()
            self.endpoint = _bind(self._pub, options.endpoint)
            if options.replay_endpoint is not None:
                what = "--kv-events-replay"
                self._router = self._replay_socket()
                self.replay_endpoint = _bind(self._router, options.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            self._queue.close()
            endpoint = options.endpoint if what == "--kv-events" else options.replay_endpoint
            raise ConfigError(f"{what} cannot bind {endpoint}: {exc}") from None
        self._index.watch(self._queue.offer)
        self._thread = threading.Thread(target=self._run, name="master-kv-events", daemon=True)
        self._thread.start()
        log.info(
            "KV events on %s%s", self.endpoint, f", replay on {self.replay_endpoint}" if self.replay_endpoint else ""
        )
        return self

    def stop(self) -> None:
        """Stop watching, publish what is queued, close the sockets (idempotent)."""
        self._index.watch(None)
        self._stopping.set()
        if self._thread is not None:
            self._queue.wake()
            self._thread.join(timeout=10)
            if self._thread.is_alive():
                log.warning("KV event publisher did not stop within 10 s")
                return
            self._thread = None
        self._close_sockets()
        self._queue.close()

    def _publisher_socket(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.SNDHWM, self._options.hwm)
        sock.setsockopt(zmq.LINGER, _LINGER_MS)
        self._guard(sock)
        return sock

    def _replay_socket(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.SNDHWM, self._options.replay_messages + 1)  # a whole replay, end marker too
        sock.setsockopt(zmq.LINGER, 0)
        self._guard(sock)
        return sock

    def reauthenticate(self) -> None:
        """The access file was reloaded: make every subscriber and replay requester connect and
        authenticate again (their sockets do so by themselves), so a revoked token is cut off."""
        if self._access is not None:
            self._rebind_due = True
            self._queue.wake()

    def _rebind(self, poller: zmq.Poller) -> None:
        """Close both sockets and bind new ones at the addresses bound before (on the thread)."""
        self._rebind_due = False
        old = [(self._pub, self.endpoint, self._publisher_socket)]
        if self._router is not None:
            old.append((self._router, self.replay_endpoint, self._replay_socket))
        fresh = []
        for sock, endpoint, make in old:
            if sock is self._router:
                poller.unregister(sock)
            sock.setsockopt(zmq.LINGER, 0)
            sock.close()
            fresh.append(self._bind_again(make, endpoint))
        self._pub = fresh[0]
        if self._router is not None:
            self._router = fresh[1]
            poller.register(self._router, zmq.POLLIN)
        log.warning("access file reloaded: KV event subscribers connect and authenticate again")

    def _bind_again(self, make, endpoint: str) -> zmq.Socket:
        """A new socket bound at ``endpoint``, once ZMQ has let the closed one's port go."""
        error = None
        for _ in range(50):  # up to a second
            sock = make()
            try:
                sock.bind(endpoint)
                return sock
            except zmq.ZMQError as exc:
                sock.close(0)
                error = exc
                time.sleep(0.02)
        raise ConfigError(f"KV events: cannot bind {endpoint} again after the access file was reloaded: {error}")

    def _guard(self, sock: zmq.Socket) -> None:
        """With an access file: make ``sock`` ask the ZAP handler about every peer (PLAIN)."""
        if self._zap is not None:
            sock.setsockopt(zmq.PLAIN_SERVER, 1)
            sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._router, self._zap):
            if sock is not None:
                sock.close()
        self._pub = self._router = self._zap = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # -- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        wake_fd = self._queue.fileno()
        poller.register(wake_fd, zmq.POLLIN)
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        if self._zap is not None:
            poller.register(self._zap, zmq.POLLIN)
        interval = self._options.flush_interval_s
        next_flush = time.monotonic()
        while True:
            timeout_ms = max(0.0, next_flush - time.monotonic()) * 1000
            try:
                ready = dict(poller.poll(timeout_ms))
                if self._rebind_due:
                    self._rebind(poller)
                    continue
                if self._zap is not None and self._zap in ready:
                    self._serve_zap()
                if self._router is not None and self._router in ready:
                    try:
                        self._serve_replays()
                    except zmq.ZMQError as exc:  # one requester's trouble; the stream goes on
                        log.warning("KV event replay failed: %s", exc)
                stopping = self._stopping.is_set()
                if stopping or wake_fd in ready or time.monotonic() >= next_flush:
                    self._flush()
                    next_flush = time.monotonic() + interval
                if stopping:
                    return
            except Exception:  # keep publishing whatever happens; what was taken is lost: resync
                log.exception("KV event publisher failed; resyncing subscribers on the next flush")
                self._resync_due = True
                if self._stopping.wait(0.1):
                    return

    def _flush(self) -> None:
        items, overflowed = self._queue.take()
        if overflowed:
            log.warning(
                "KV event queue full (%d changes): dropped changes (%d since start); "
                "resyncing subscribers (AllBlocksCleared, then every block)",
                self._options.max_pending,
                self._queue.dropped,
            )
        if overflowed or self._resync_due:
            self._resync_due = False
            self._resync()
        by_namespace: dict[str, list[Event]] = {}
        for changes, emptied in items:
            for namespace, diff in changes:
                append_events(by_namespace.setdefault(namespace, []), events_for(diff))
            if emptied:  # the clear comes after the removals that emptied the index, before what follows
                self._publish(by_namespace)
                by_namespace = {}
                self._send(self._prefix, [CLEAR])
                self._announced.clear()
        self._publish(by_namespace)

    def _resync(self) -> None:
        """AllBlocksCleared on the bare topic and on each namespace a subscriber may hold blocks of,
        then BlockStored for every block the index holds now."""
        self._resyncs += 1
        index = self._index
        namespaces = index.namespaces()
        self._send(self._prefix, [CLEAR])
        for namespace in sorted(self._announced.union(namespaces)):
            self._send(self._prefix + namespace.encode(), [CLEAR])
        self._announced = set(namespaces[:_MAX_ANNOUNCED])
        for namespace in namespaces:
            start_after = b""
            while True:
                page = index.list_keys(namespace, _SNAPSHOT_PAGE, start_after)
                if page:
                    self._publish({namespace: events_for([(d, NO_HOLDERS, h) for _, d, h in page])})
                if len(page) < _SNAPSHOT_PAGE:
                    break
                start_after = page[-1][1]

    def _publish(self, by_namespace: dict[str, list[Event]]) -> None:
        for namespace, events in by_namespace.items():
            if events:
                self._note_announced(namespace, events)
                topic = self._prefix + namespace.encode()
                for message in split_events(events, self._options.max_block_hashes):
                    self._send(topic, message)

    def _note_announced(self, namespace: str, events: list[Event]) -> None:
        if namespace in self._announced or not any(kind == STORED for kind, _, _ in events):
            return
        if len(self._announced) < _MAX_ANNOUNCED:
            self._announced.add(namespace)
        elif not self._announced_full:
            self._announced_full = True
            log.warning(
                "more than %d namespaces: after a resync, subscribers filtering the later ones may keep "
                "blocks removed while changes were dropped",
                _MAX_ANNOUNCED,
            )

    def _send(self, topic: bytes, events: list[Event]) -> None:
        payload = self._encoder.encode(time.time(), events)
        seq = self._seq
        self._seq += 1
        try:
            self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:  # PUB drops for slow subscribers rather than block; this is the same
            pass
        self._buffer.add(seq, topic, payload)
        self._messages += 1
        for kind, _medium, digests in events:
            self._events[kind] += 1
            if kind != CLEARED:
                self._blocks[kind] += len(digests)

    def _serve_replays(self) -> None:
        """Answer waiting replay requests as vLLM's publisher does (see kvstore.master.kv_events)."""
        router = self._router
        for _ in range(_REPLAYS_PER_WAKE):
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._replay_requests += 1
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                self._bad_requests += 1
                if self._bad_requests == 1:
                    log.warning(
                        "bad KV event replay request (%d frames): expected identity, empty frame, "
                        "8-byte big-endian start sequence number (later ones only counted)",
                        len(frames),
                    )
                if len(frames) >= 2:  # let a waiting client stop waiting
                    self._reply(frames[0], b"", END_SEQ, b"")
                continue
            identity, _, start = frames
            messages = list(self._buffer.since(int.from_bytes(start, "big")))
            if not self._afford(len(messages)):
                self._replay_deferred += 1
                messages = []  # over the replay budget: the end marker alone, to ask again later
            for seq, topic, payload in messages:
                if not self._reply(identity, topic, seq.to_bytes(8, "big"), payload):
                    break
            self._reply(identity, b"", END_SEQ, b"")

    def _afford(self, messages: int) -> bool:
        """Take ``messages`` from the replay budget (``replay_rate`` a second, at most a whole
        buffer banked); False when it does not hold them now."""
        now = time.monotonic()
        options = self._options
        self._replay_tokens = min(
            float(options.replay_messages), self._replay_tokens + (now - self._replay_refilled) * options.replay_rate
        )
        self._replay_refilled = now
        if messages > self._replay_tokens:
            return False
        self._replay_tokens -= messages
        return True

    def _serve_zap(self) -> None:
        """Answer ZMQ's authentication requests (ZAP 1.0): PLAIN with an admin token, else 400."""
        for _ in range(_REPLAYS_PER_WAKE):
            try:
                frames = self._zap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            version, request_id = (frames + [b"", b""])[:2]
            principal = None
            if len(frames) == 8 and version == b"1.0" and frames[5] == b"PLAIN":
                principal = self._access.bearer(frames[7].decode("utf-8", "replace"))
            if principal is not None and principal.role == ADMIN:
                self._zap.send_multipart([b"1.0", request_id, b"200", b"OK", principal.name.encode(), b""])
                continue
            self._refused_subscribers += 1
            if self._refused_subscribers == 1:
                log.warning("refused a KV events subscriber without an admin token (later ones only counted)")
            self._zap.send_multipart([b"1.0", request_id, b"400", b"an admin token is required", b"", b""])

    def _reply(self, identity: bytes, topic: bytes, seq: bytes, payload: bytes) -> bool:
        try:
            # copy=False: the frames share the buffered payload instead of copying it per requester
            self._router.send_multipart((identity, b"", topic, seq, payload), flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False

    # -- metrics ------------------------------------------------------------------------------
    def samples(self) -> list[Sample]:
        """Prometheus samples of the publisher (the master adds them to its own)."""
        samples: list[Sample] = [
            (
                "kvstore_master_kv_events_messages_total",
                "KVEventBatch messages published on the KV events socket.",
                "counter",
                {},
                self._messages,
            )
        ]
        samples += [
            ("kvstore_master_kv_events_total", "KV events published, by type.", "counter", {"type": t}, n)
            for t, n in self._events.items()
        ]
        samples += [
            (
                "kvstore_master_kv_events_blocks_total",
                "Block hashes announced, by event type.",
                "counter",
                {"type": t},
                n,
            )
            for t, n in self._blocks.items()
        ]
        samples += [
            (
                "kvstore_master_kv_events_dropped_total",
                "Index changes dropped because the KV event queue was full (each drop is followed by a resync).",
                "counter",
                {},
                self._queue.dropped,
            ),
            (
                "kvstore_master_kv_events_resyncs_total",
                "Times the whole index was republished (AllBlocksCleared, then every block): at start and after drops.",
                "counter",
                {},
                self._resyncs,
            ),
            (
                "kvstore_master_kv_events_queued",
                "Index changes waiting to be published.",
                "gauge",
                {},
                self._queue.pending,
            ),
            (
                "kvstore_master_kv_events_replay_requests_total",
                "Replay requests received (malformed ones too).",
                "counter",
                {},
                self._replay_requests,
            ),
            (
                "kvstore_master_kv_events_replays_deferred_total",
                "Replay requests answered with the end marker alone: over the replay budget (replay_rate).",
                "counter",
                {},
                self._replay_deferred,
            ),
            (
                "kvstore_master_kv_events_refused_subscribers_total",
                "Connections to the KV events sockets refused for want of an admin token (with an access file).",
                "counter",
                {},
                self._refused_subscribers,
            ),
            (
                "kvstore_master_kv_events_replay_buffer_messages",
                "Messages kept for replay.",
                "gauge",
                {},
                len(self._buffer),
            ),
        ]
        return samples
