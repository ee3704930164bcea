"""Data-plane client connections: bulk block bytes between the SDK and one node.

    TcpConnection("host:port")            framed binary over TCP
    UnixConnection("/run/kvstore.sock")   the same frames over a Unix socket
    ShmConnection(target, arena_name)     same host: reads and writes go straight
                                          through the node's shared-memory arena;
                                          the socket carries only small control frames
                                          (in ``kvstore_client.shm``, re-exported here)

A connection is one ordered byte stream and is NOT thread-safe: open one per
thread (they are cheap: a socket and one INFO round trip). Frames are in
``proto/dataplane.md``.

With ``credentials`` holding a token a connection first authenticates (the
challenge-response of ``kvstore_client.auth``; a node that checks tokens
answers nothing before that); with a TLS CA, TCP connections are TLS.

Every call is a batch. Reads raise after the whole reply is consumed, so a
per-key failure (BufferTooSmall, UnknownNamespace, ChecksumMismatch...) leaves
the connection usable; misses are None. ``read_many`` returns those per-key
errors instead of raising them. ``put_many`` reports per item instead
of raising, because some items of a batch may be stored while others are not:
it returns one ``None`` (stored) or typed exception instance per item, and
``put`` raises that exception. A connection that died mid-transfer raises
TransportError, a node that rejected a frame ProtocolError; both leave the
connection closed. Big batches are split so that no frame exceeds the node's
``max_frame_bytes``, with up to two frames in flight (``Tuning``: each connection's window,
items per frame, puts left unanswered and reply polling). Shared-memory reads
release their leases late, in front of the connection's next request;
``flush()`` releases them at once (and is a no-op on socket transports).

``put_many(items, wait=False)`` sends and returns: the node's replies are read
in front of the reply to the connection's next request, or by ``flush()``
(at most ``UNACKED_MAX`` frames stay unanswered, or the connection's ``Tuning``). What such puts failed to
store, a dead connection's unanswered items included, collects in
``put_failures`` as (key, error) pairs.
"""

from __future__ import annotations

import json
import socket
import ssl
import struct
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

from kvstore_client.auth import DataKey, Handshake
from kvstore_client.credentials import NO_CREDENTIALS, Credentials
from kvstore_client.buffers import buffer_view, newly_allocated, receivable_bytes
from kvstore_client.cuda import DeviceView, send_from
from kvstore_client.errors import (
    BufferTooSmall,
    ChecksumMismatch,
    ConfigError,
    InvalidValue,
    KVStoreError,
    ProtocolError,
    TransportError,
)
from kvstore_client.keys import MAX_DIGEST_LEN, MAX_NAMESPACE_LEN, BlockKey, check_key
from kvstore_client.slices import SliceHasher, ValueHasher, unpack_preamble, value_checksum
from kvstore_client.wire import (
    FLAG_CHECKSUMS_LAST,
    FLAG_NO_REPLY,
    GET_ITEM,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    PIECEWISE_FROM,
    PUT_ENTRY,
    RANGE_ITEM,
    U64,
    VERSION,
    FrameReader,
    Op,
    Status,
    error_for,
    key_entry,
    pack_header,
    pull_entry,
    put_entry,
    range_entry,
    reply_spin,
    send_buffers,
    unpack_header,
)

_checksum = value_checksum
_pack_header = HEADER.pack
_pack_release1 = struct.Struct(HEADER.format + "Q").pack  # a RELEASE frame of one lease id
WINDOW = 2  # frames in flight: the next is sent while the node answers the previous
KEYS_PER_FRAME = 256  # keys-only requests stay small (< 64 KiB), so pipelining cannot deadlock
OVERLAP_HASH_BYTES = 512 << 10  # PUT frames this large send their checksums after the payloads (measured)
UNIX_SOCKET_BUFFER = 4 << 20
_MAX_AUTH_REPLY = 4096
UNACKED_MAX = 8  # frames of puts sent without waiting that may stay unanswered (replies are a few bytes)


@dataclass(frozen=True)
class Tuning:
    """A connection's tuning (``Client(...)`` takes each as a keyword argument; the defaults are
    the module's constants). ``window``: request frames in flight, the next sent while the node
    answers the previous. ``keys_per_frame``: items in one frame at most (keys-only requests stay
    small, so that pipelining cannot deadlock). ``max_unacked_puts``: frames of puts sent without
    waiting that may stay unanswered. ``reply_spin``: seconds to poll for a small reply before
    sleeping (None: ``wire.reply_spin()``, KVSTORE_REPLY_SPIN_US, read when the connection is made)."""

    window: int = WINDOW
    keys_per_frame: int = KEYS_PER_FRAME
    max_unacked_puts: int = UNACKED_MAX
    reply_spin: float | None = None

    def __post_init__(self) -> None:
        for name in ("window", "keys_per_frame"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                raise ConfigError(f"{name} must be an int of at least 1, got {getattr(self, name)!r}")
        if type(self.max_unacked_puts) is not int or self.max_unacked_puts < 0:
            raise ConfigError(f"max_unacked_puts must be an int of at least 0, got {self.max_unacked_puts!r}")
        if self.reply_spin is not None and not self.reply_spin >= 0:
            raise ConfigError(f"reply_spin must be seconds, at least 0, got {self.reply_spin!r}")


DEFAULT_TUNING = Tuning()


if TYPE_CHECKING:
    from kvstore_client.tls import TLSSocket


def _connect(target: str, timeout: float | None, tls: ssl.SSLContext | None = None) -> socket.socket | TLSSocket:
    """A connected socket: a Unix socket for a path, TCP for "host:port" (TLS with ``tls``)."""
    try:
        if "/" in target or ":" not in target:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            sock.connect(target)
        else:
            host, port = target.rsplit(":", 1)
            sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls is not None:
                from kvstore_client.tls import wrap_client

                try:
                    return wrap_client(sock, tls, host.strip("[]"))
                except BaseException:
                    sock.close()
                    raise
    except ssl.SSLError as exc:
        raise TransportError(f"TLS with the data plane at {target} failed: {exc.reason or exc}") from exc
    except OSError as exc:
        raise TransportError(f"cannot connect to data plane at {target}: {exc}") from exc
    if sock.family == socket.AF_UNIX:  # small defaults; TCP autotunes better than any fixed size
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UNIX_SOCKET_BUFFER)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, UNIX_SOCKET_BUFFER)
    return sock


def _split(
    indices: list[int], costs: Sequence[int] | Mapping[int, int], budget: int, max_items: int
) -> list[list[int]]:
    """Consecutive chunks of ``indices`` whose costs sum to at most ``budget`` (one item at least);
    ``costs[i]`` is item i's cost."""
    chunks: list[list[int]] = []
    chunk: list[int] = []
    used = 0
    for i in indices:
        if chunk and (used + costs[i] > budget or len(chunk) >= max_items):
            chunks.append(chunk)
            chunk, used = [], 0
        chunk.append(i)
        used += costs[i]
    if chunk:
        chunks.append(chunk)
    return chunks


def _raise_first(errors: dict[int, KVStoreError]) -> None:
    if errors:
        raise errors[min(errors)]


def _found(statuses: list[int]) -> list[bool]:
    """Per item, OK (True) or NOT_FOUND (False); any other status raises, the first one's error."""
    _raise_first({i: error_for(s) for i, s in enumerate(statuses) if s not in (Status.OK, Status.NOT_FOUND)})
    return [s == Status.OK for s in statuses]


def _range(r) -> tuple[int, int]:
    """A range of slices as (first, count), from a pair or a ``range`` of step 1."""
    if isinstance(r, range) and r.step == 1:
        r = (r.start, len(r))
    if not (isinstance(r, tuple) and len(r) == 2 and all(type(x) is int for x in r)):
        raise InvalidValue(f"a range of slices is (first, count) or a range of step 1, not {r!r}")
    first, count = r
    if not (0 <= first < 1 << 32 and 0 < count < 1 << 32):
        raise InvalidValue(f"slices {first}..{first + count - 1} cannot be in a value")
    return first, count


def _put_item(item) -> tuple[BlockKey, memoryview | DeviceView, int]:
    key, value, *rest = item
    depth = rest[0] if rest else 0
    if type(depth) is not int or not 0 <= depth < 1 << 32:
        raise InvalidValue(f"depth must be an int in [0, 2**32), got {depth!r}")
    return check_key(key), buffer_view(value), depth


class _StreamGuard:
    """What ``DataPlaneConnection._stream`` returns (one per connection, reused: a plain
    class is cheaper than a generator context manager on every request)."""

    __slots__ = ("_conn",)

    def __init__(self, conn: "DataPlaneConnection"):
        self._conn = conn

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> None:
        if exc is None:
            return
        if isinstance(exc, OSError):
            self._conn._die(str(exc))
            raise TransportError(f"data-plane connection failed: {exc}") from exc
        self._conn._die(f"{kind.__name__}: {exc}")


class DataPlaneConnection:
    """Operations shared by every transport, over one stream socket. One per thread."""

    def __init__(
        self,
        sock: socket.socket | TLSSocket,
        *,
        verify: bool = True,
        credentials: Credentials = NO_CREDENTIALS,
        tuning: Tuning = DEFAULT_TUNING,
    ):
        self.verify = verify  # check each block's XXH3-64 against the node's checksum
        self.tuning = tuning
        self._window, self.keys_per_frame, self._unacked_max = (
            tuning.window,
            tuning.keys_per_frame,
            tuning.max_unacked_puts,
        )
        self._sock = sock
        self._reader = FrameReader(sock, spin=reply_spin() if tuning.reply_spin is None else tuning.reply_spin)
        self._request_id = 0
        self._dead: str | None = None
        self._finished: list[int] = []  # lease ids done with (shared memory): released with the next request
        self._touched: list[bytes] = []  # key entries of one-sided reads (shared memory): reported likewise
        self._guard = _StreamGuard(self)
        self._unacked: deque = deque()  # (request id, keys, read its reply -> statuses) of puts not waited for
        self._collecting = False  # reading those replies: _reply must not start on the next one
        self.put_failures: list[tuple[BlockKey, KVStoreError]] = []
        self.token_name: str | None = None  # the token the node knows this connection by
        try:
            if credentials.data_key is not None:
                self._authenticate(credentials.data_key)
            self._info = self.info(refresh=True)
        except BaseException:
            self.close()
            raise
        self.max_frame_bytes = int(self._info["max_frame_bytes"])
        self.max_block_bytes = int(self._info["max_block_bytes"])
        self.max_items = int(self._info["max_items"])
        self.keys_per_frame = min(self.keys_per_frame, self.max_items)

    def _authenticate(self, key: DataKey) -> None:
        """The data-plane challenge-response (kvstore_client.auth); Unauthenticated when the
        node refuses the token or cannot prove it holds it."""
        handshake = Handshake(key)
        with self._stream():
            proof = handshake.challenge(self._auth_reply(self._send(Op.AUTH, 0, handshake.hello())))
            if proof is not None:
                self.token_name = handshake.accepted(self._auth_reply(self._send(Op.AUTH, 0, proof)))

    def _auth_reply(self, request_id: int) -> bytes:
        body_len = self._reply(Op.AUTH, request_id, 0)
        if body_len > _MAX_AUTH_REPLY:
            raise ProtocolError(f"AUTH reply of {body_len} bytes: not a kvstore node")
        return bytes(self._reader.read(body_len))

    # -- framing ----------------------------------------------------------------------------
    def _stream(self) -> "_StreamGuard":
        """A context in which any failure leaves the byte stream out of sync: the connection is closed."""
        if self._dead is not None:
            raise TransportError(f"connection is closed ({self._dead})")
        return self._guard

    def _die(self, reason: str) -> None:
        self._dead = reason
        failure = TransportError(f"connection failed before the node answered the put ({reason})")
        while self._unacked:  # sent, never answered: the caller must not think them stored
            self.put_failures.extend((key, failure) for key in self._unacked.popleft()[1])
        try:
            self._sock.close()
        except OSError:
            pass

    def _send(self, op: int, count: int, table: bytes, payloads=(), body_extra: int = 0, flags: int = 0) -> int:
        """Send one request frame (table, then payloads); its request id."""
        lead = self._lead_frames() if self._finished or self._touched else b""
        self._request_id = request_id = (self._request_id + 1) & 0xFFFFFFFF
        head = lead + _pack_header(MAGIC, VERSION, op, 0, flags, request_id, count, len(table) + body_extra)
        if payloads:
            send_buffers(self._sock, [head + table, *payloads])
        else:
            self._sock.sendall(head + table)
        return request_id

    def _lead_frames(self) -> bytes:
        """RELEASE and TOUCH frames (NO_REPLY) of what is pending, to go out in front of the next request."""
        lead = self._release_frame() if self._finished else b""
        if self._touched:
            entries, self._touched = self._touched, []
            self._request_id = request_id = (self._request_id + 1) & 0xFFFFFFFF
            body = b"".join(entries)
            lead += pack_header(Op.TOUCH, request_id, len(entries), len(body), flags=FLAG_NO_REPLY) + body
        return lead

    def _release_frame(self) -> bytes:
        """A RELEASE (NO_REPLY) frame of the finished lease ids."""
        ids, self._finished = self._finished, []
        self._request_id = request_id = (self._request_id + 1) & 0xFFFFFFFF
        if len(ids) == 1:
            return _pack_release1(MAGIC, VERSION, Op.RELEASE, 0, FLAG_NO_REPLY, request_id, 1, U64.size, ids[0])
        return pack_header(Op.RELEASE, request_id, len(ids), U64.size * len(ids), flags=FLAG_NO_REPLY) + struct.pack(
            f"<{len(ids)}Q", *ids
        )

    def flush(self) -> None:
        """Read the replies of puts sent without waiting (``settle``); then report, and wait for
        the node to confirm, what shared-memory reads left pending: the leases they finished
        with (released) and the blocks they read by themselves (counted as hits). Both
        otherwise go out with this connection's next request, and leases expire after the
        node's lease TTL. A no-op when nothing is pending."""
        self.settle()
        if not (self._finished or self._touched) or self._dead is not None:
            return
        with self._stream():
            self._reader.skip(self._reply(Op.PING, self._send(Op.PING, 0, b""), 0))

    def settle(self) -> None:
        """Read the replies of the puts sent without waiting (a read that asks no node calls
        it first, so that it sees them)."""
        if self._unacked and self._dead is None:
            with self._stream():
                self._collect_unacked()

    def _defer(self, request_id: int, keys: list, collect) -> None:
        """Leave the reply to ``request_id`` (puts of ``keys``) for later: ``collect(request_id)``
        reads it and returns the statuses. Reads the oldest such replies when too many wait."""
        self._unacked.append((request_id, keys, collect))
        if len(self._unacked) > self._unacked_max:
            self._collect_unacked(self._unacked_max)

    def _collect_unacked(self, keep: int = 0) -> None:
        """Read the replies of puts not waited for, oldest first, until ``keep`` remain; what
        they failed to store goes to ``put_failures``. Inside a ``_stream`` (a failure kills the
        connection, which reports the rest)."""
        self._collecting = True
        try:
            while len(self._unacked) > keep:
                request_id, keys, collect = self._unacked[0]
                try:
                    statuses = collect(request_id)
                except KVStoreError as exc:
                    self._unacked.popleft()
                    self.put_failures.extend((key, exc) for key in keys)
                    raise
                self._unacked.popleft()
                self.put_failures.extend(
                    (key, error_for(status)) for key, status in zip(keys, statuses) if status != Status.OK
                )
        finally:
            self._collecting = False

    def _reply(self, op: int, request_id: int, count: int | None) -> int:
        """Read a reply header for ``request_id`` (after those of puts sent before it without
        waiting); its body_len. Error frames raise their typed error."""
        if self._unacked and not self._collecting:
            self._collect_unacked()
        r_op, status, _, r_id, r_count, body_len = unpack_header(self._reader.read(HEADER_SIZE, op != Op.GET))
        if r_op == Op.ERROR or status != Status.OK:
            message = bytes(self._reader.read(body_len)).decode(errors="replace") if body_len <= 65536 else ""
            raise error_for(status, f"node rejected the request: {message}")
        if r_op != op or r_id != request_id or (count is not None and r_count != count):
            raise ProtocolError(
                f"reply (op {r_op}, id {r_id}, {r_count} items) does not answer request (op {op}, id {request_id})"
            )
        return body_len

    def _pipeline(self, chunks: list, send, receive) -> None:
        """send(chunk) -> request id for each chunk, receive(chunk, request id) in order, ``window`` in flight."""
        pending: deque = deque()
        with self._stream():
            for chunk in chunks:
                pending.append((chunk, send(chunk)))
                if len(pending) >= self._window:
                    receive(*pending.popleft())
            while pending:
                receive(*pending.popleft())

    def _keys_request(self, op: int, keys: list, chunk: list[int], flags: int = 0) -> int:
        return self._send(op, len(chunk), b"".join([key_entry(keys[j]) for j in chunk]), flags=flags)

    # -- reads ---------------------------------------------------------------------------------
    def get_into_many(self, keys, buffers) -> list[int | None]:
        """Copy each block into its buffer (any writable contiguous buffer); sizes, None for misses.

        Over a socket the bytes are received straight into the buffers (scatter
        reads), except the few KiB that arrive together with the reply header,
        which are copied from the connection's read buffer. Raises
        BufferTooSmall (``.needed``) for a block larger than its buffer, after
        filling every other buffer.
        """
        results, errors = self.read_many(keys, buffers)
        _raise_first(errors)
        return results

    def get_many(self, keys) -> list[bytes | None]:
        """Each block's bytes, None for misses (get_into_many avoids the allocation)."""
        results, errors = self.read_many(keys)
        _raise_first(errors)
        return results

    def read_many(self, keys, buffers=None) -> tuple[list, dict[int, KVStoreError]]:
        """``get_many`` (or with ``buffers``, ``get_into_many``) that returns the per-key
        errors instead of raising the first: (results, {index: error}); the results of
        keys with an error are None. Connection failures still raise."""
        keys = [check_key(k) for k in keys]
        views = None if buffers is None else [buffer_view(b, writable=True) for b in buffers]
        if views is not None and len(views) != len(keys):
            raise InvalidValue(f"{len(keys)} keys but {len(views)} buffers")
        return self._read_views(keys, views)

    def _read_views(self, keys: list, views: list | None) -> tuple[list, dict]:
        """``read_many`` of checked keys (into checked ``views``, or as bytes when None)."""
        return self._get_bytes(keys) if views is None else self._get_into(keys, views)

    def _get_into(self, keys: list, views: list) -> tuple[list, dict]:
        results: list = [None] * len(keys)
        errors: dict[int, KVStoreError] = {}

        def target(j: int, size: int | None):
            if size is None:  # a retry found no block after all: forget the earlier copy
                results[j] = None
                return None
            if size > len(views[j]):
                errors[j] = BufferTooSmall(f"block {j} is {size} bytes, buffer holds {len(views[j])}", size)
                return None
            results[j] = size
            return views[j][:size]

        self._read_checked(keys, list(range(len(keys))), [len(v) for v in views], target, errors)
        for j in errors:
            results[j] = None
        return results, errors

    def _get_bytes(self, keys: list) -> tuple[list, dict]:
        """Blocks are received straight into new bytes objects (``receivable_bytes``): one
        copy, as for get_into. A block is handed out only once it is in and verified."""
        out: dict[int, bytes] = {}
        errors: dict[int, KVStoreError] = {}
        placed: dict[int, bytes] = {}

        def target(j: int, size: int | None):
            out.pop(j, None)
            if size is None:  # a retry found no block after all: forget the earlier copy
                placed.pop(j, None)
                return None
            placed[j], view = receivable_bytes(size)
            return view

        def landed() -> None:  # the blocks placed so far are in and verified
            for j, block in placed.items():
                if j not in errors:
                    out[j] = block
            placed.clear()

        # sizes are unknown: chunk by count; the node defers what overflows a frame (FRAME_TOO_LARGE)
        self._read_checked(keys, list(range(len(keys))), [0] * len(keys), target, errors, landed)
        return [out.get(j) for j in range(len(keys))], errors

    def read_ranges(self, keys, ranges, buffers) -> tuple[list, dict[int, KVStoreError]]:
        """Slices of sliced values (``kvstore_client.slices``): for each j, slices
        ``ranges[j] = (first, count)`` of ``keys[j]``'s value, back to back, into ``buffers[j]``;
        (sizes, None for a miss; {index: error}). Each slice is checked against its own
        checksum as it lands; one that arrived damaged is asked about (VERIFY) as a GET's
        block is: dropped at the node (a miss) or read once more. A value that is not sliced,
        or has fewer slices, is an InvalidValue for its index. A key may come more than once."""
        keys = [check_key(k) for k in keys]
        views = [buffer_view(b, writable=True) for b in buffers]
        ranges = [_range(r) for r in ranges]
        if not len(keys) == len(views) == len(ranges):
            raise InvalidValue(f"{len(keys)} keys, {len(ranges)} ranges and {len(views)} buffers")
        results: list = [None] * len(keys)
        errors: dict[int, KVStoreError] = {}
        self._read_ranges(keys, ranges, views, list(range(len(keys))), results, errors)
        damaged = [j for j, error in errors.items() if isinstance(error, ChecksumMismatch)]
        if damaged:
            statuses = self._item_statuses(Op.VERIFY, [keys[j] for j in damaged])
            again = [j for j, status in zip(damaged, statuses) if status == Status.OK]
            for j in damaged:
                del errors[j]
            self._read_ranges(keys, ranges, views, again, results, errors)
        for j in errors:
            results[j] = None
        return results, errors

    def _read_ranges(self, keys: list, ranges: list, views: list, todo: list[int], results: list, errors: dict):
        budget = self.max_frame_bytes - self.keys_per_frame * RANGE_ITEM.size
        costs = [len(view) + 12 * count for view, (_, count) in zip(views, ranges)]
        reader = self._reader
        while todo:
            deferred: list[int] = []

            def send(chunk: list[int]) -> int:
                table = b"".join([range_entry(keys[j], *ranges[j]) for j in chunk])
                return self._send(Op.GET_RANGES, len(chunk), table)

            def receive(chunk: list[int], request_id: int) -> None:
                body_len = self._reply(Op.GET_RANGES, request_id, len(chunk))
                items = list(RANGE_ITEM.iter_unpack(reader.read(len(chunk) * RANGE_ITEM.size)))
                body = len(chunk) * RANGE_ITEM.size
                body += sum(size + 12 * ranges[j][1] for j, (st, size) in zip(chunk, items) if st == Status.OK)
                if body_len != body:
                    raise ProtocolError("GET_RANGES reply body_len does not match its table")
                for j, (status, size) in zip(chunk, items):
                    if status == Status.OK:
                        self._receive_range(j, size, ranges[j][1], views[j], results, errors)
                    elif status == Status.FRAME_TOO_LARGE:
                        deferred.append(j)
                    elif status != Status.NOT_FOUND:
                        errors[j] = error_for(status)
                if deferred and deferred[0] == chunk[0]:
                    raise ProtocolError("GET_RANGES reply deferred the first item of its request")

            self._pipeline(_split(todo, costs, budget, self.keys_per_frame), send, receive)
            todo = deferred

    def _receive_range(self, j: int, size: int, count: int, view, results: list, errors: dict) -> None:
        """One range of a GET_RANGES reply: its slices' checksums and lengths, then its bytes,
        straight into ``view``, each slice hashed as it lands."""
        reader = self._reader
        checksums, lengths = unpack_preamble(reader.read(12 * count), count)
        if sum(lengths) != size:
            raise ProtocolError("GET_RANGES slice lengths do not add up to the range")
        if size > len(view):
            reader.skip(size)
            errors[j] = BufferTooSmall(f"range {j} is {size} bytes, buffer holds {len(view)}", size)
            return
        hasher = SliceHasher(lengths) if self.verify else None
        out = view if size == len(view) else view[:size]
        if type(out) is DeviceView:
            out.receive(reader, hasher)
        else:
            reader.readinto(out, hasher)
        if hasher is not None and tuple(hasher.digests()) != checksums:
            errors[j] = ChecksumMismatch(f"range {j} arrived damaged (a slice's checksum does not match)")
            return
        results[j] = size
        errors.pop(j, None)

    def get_with(self, keys, place, landed=None) -> dict[int, KVStoreError]:
        """GET each block of ``keys`` straight into ``place(j, size)``, a writable view of
        exactly ``size`` bytes chosen once the block's size is known (None: drop the block;
        ``place(j, None)``: forget what was placed for j, which is read again).
        ``landed(errors)`` runs each time the blocks placed so far are in and verified, with
        the per-key errors so far (damaged blocks among them: do not keep those). Returns
        those errors; misses are neither placed nor errors."""
        keys = [check_key(k) for k in keys]
        errors: dict[int, KVStoreError] = {}
        self._read(
            keys,
            list(range(len(keys))),
            [0] * len(keys),
            place,
            errors,
            None if landed is None else lambda: landed(errors),
        )
        return errors

    def _read_checked(
        self, keys: list, todo: list[int], costs: list[int], target, errors: dict, landed=None, read=None
    ) -> None:
        """``read`` (default ``_read``), then ask the node (VERIFY) about the blocks that arrived
        damaged: one the node finds damaged too is dropped there and reads as a miss, as a
        damaged SSD record does; one it finds intact was damaged on the way and is read once
        more, after which a ChecksumMismatch stands."""
        read = read or (self._read_single if len(keys) == 1 else self._read)
        read(keys, todo, costs, target, errors, landed)
        damaged = [j for j, error in errors.items() if isinstance(error, ChecksumMismatch)]
        if not damaged:
            return
        again = []
        for j, status in zip(damaged, self._item_statuses(Op.VERIFY, [keys[j] for j in damaged])):
            target(j, None)
            del errors[j]
            if status == Status.OK:
                again.append(j)
        if again:
            read(keys, again, costs, target, errors, landed)

    def _read(self, keys: list, todo: list[int], costs: list[int], target, errors: dict, landed=None) -> None:
        """GET ``keys[j]`` for j in todo, block j into ``target(j, size)`` (a view, or None to drop it;
        ``target(j, None)`` forgets an earlier call for j); per-key failures go to ``errors``;
        ``landed()``, when given, runs after each reply's blocks are in and verified.
        Frames hold at most ``max_frame_bytes`` of ``costs``."""
        budget = self.max_frame_bytes - self.keys_per_frame * GET_ITEM.size
        while todo:
            deferred: list[int] = []

            def receive(chunk: list[int], request_id: int) -> None:
                body_len = self._reply(Op.GET, request_id, len(chunk))
                items = list(GET_ITEM.iter_unpack(self._reader.read(len(chunk) * GET_ITEM.size)))
                if body_len != len(chunk) * GET_ITEM.size + sum(s for st, s, _ in items if st == Status.OK):
                    raise ProtocolError("GET reply body_len does not match its table")
                blocks = []  # (j, where its bytes go, checksum)
                for j, (status, size, checksum) in zip(chunk, items):
                    if status == Status.OK:
                        out = target(j, size)
                        blocks.append((j, memoryview(bytearray(size)) if out is None else out, checksum))
                    elif status == Status.FRAME_TOO_LARGE:
                        deferred.append(j)
                    elif status != Status.NOT_FOUND:
                        errors[j] = error_for(status)
                self._receive_blocks(blocks, errors)
                if deferred and deferred[0] == chunk[0]:  # the node must always serve the first item
                    raise ProtocolError("GET reply deferred the first item of its request")
                if landed is not None:
                    landed()

            chunks = _split(todo, costs, budget, self.keys_per_frame)
            self._pipeline(chunks, lambda chunk: self._keys_request(Op.GET, keys, chunk), receive)
            todo = deferred

    def _receive_blocks(self, blocks: list[tuple], errors: dict) -> None:
        """Receive a GET reply's blocks, (j, where its bytes go, checksum) in reply order, and
        verify them. Blocks of ``PIECEWISE_FROM`` bytes or more go into the caller's buffers a
        piece at a time, hashed as they land (``FrameReader.readinto``); the others, and new
        bytes objects, in one scatter read per run. (Into new bytes objects, whose pages fault
        in as they fill, pieces were 15-20% slower for batches of 1 and 4 MiB blocks here.)"""
        reader = self._reader
        digests: dict[int, int] = {}
        small: list[memoryview] = []
        for j, out, _ in blocks:
            if type(out) is not DeviceView and (len(out) < PIECEWISE_FROM or newly_allocated(out)):
                small.append(out)
                continue
            if small:
                reader.readinto_many(small)
                small = []
            digest = self._receive_hashed(out)
            if digest is not None:
                digests[j] = digest
        if small:
            reader.readinto_many(small)
        if self.verify:
            for j, out, checksum in blocks:
                if j in errors:
                    continue
                if (digests[j] if j in digests else _checksum(out)) != checksum:
                    errors[j] = ChecksumMismatch(f"block {j} arrived damaged (checksum mismatch)")

    def _receive_hashed(self, out: memoryview | DeviceView) -> int | None:
        """Receive ``out``'s bytes, hashed as they land when verifying: their XXH3-64, or None.
        Into device memory (a DeviceView) they land in pinned staging first (kvstore_client.cuda)."""
        hasher = ValueHasher(len(out)) if self.verify else None
        if type(out) is DeviceView:
            out.receive(self._reader, hasher)
        else:
            self._reader.readinto(out, hasher)
        return None if hasher is None else hasher.intdigest()

    def _read_single(self, keys: list, todo: list[int], costs: list[int], target, errors: dict, landed=None) -> None:
        """``_read`` of a single key (the common call): one GET, its reply read straight into
        ``target(0, size)``, without the batch machinery (4-7% less time per call, measured)."""
        with self._stream():
            request_id = self._send(Op.GET, 1, key_entry(keys[0]))
            body_len = self._reply(Op.GET, request_id, 1)
            status, size, checksum = GET_ITEM.unpack(self._reader.read(GET_ITEM.size))
            if body_len != GET_ITEM.size + (size if status == Status.OK else 0):
                raise ProtocolError("GET reply body_len does not match its table")
            if status != Status.OK:
                if status == Status.FRAME_TOO_LARGE:
                    raise ProtocolError("GET reply deferred the first item of its request")
                if status != Status.NOT_FOUND:
                    errors[0] = error_for(status)
                return
            out = target(0, size)
            if out is None:
                self._reader.skip(size)
                return
            digest = self._receive_hashed(out)
        if digest is not None and 0 not in errors and digest != checksum:
            errors[0] = ChecksumMismatch("block 0 arrived damaged (checksum mismatch)")
        if landed is not None:
            landed()

    def get_into(self, key: BlockKey, buffer) -> int | None:
        return self.get_into_many([key], [buffer])[0]

    def get(self, key: BlockKey) -> bytes | None:
        return self.get_many([key])[0]

    # -- writes --------------------------------------------------------------------------------
    def put_many(self, items, wait: bool = True) -> list[KVStoreError | None]:
        """Store ``(key, value[, depth])`` items; per item None (stored) or the typed error.

        Values are any contiguous buffers; empty or oversized values get
        InvalidValue without being sent. Connection failures raise. With
        ``wait=False`` it returns once the values are on their way (the
        caller may reuse its buffers): None then means sent, and what the node
        refuses later goes to ``put_failures``.
        """
        results: list = [None] * len(items)
        ready: dict[int, tuple] = {}
        for i, item in enumerate(items):
            try:
                key, view, depth = _put_item(item)
                if not 0 < len(view) <= self.max_block_bytes:
                    raise InvalidValue(f"value of {len(view)} bytes: must be 1..{self.max_block_bytes} bytes")
            except KVStoreError as exc:
                results[i] = exc
                continue
            ready[i] = (key, view, depth)
        self._put(ready, results, wait)
        return results

    def _put(self, ready: dict[int, tuple], results: list, wait: bool = True) -> None:
        entry = PUT_ENTRY.size + MAX_NAMESPACE_LEN + MAX_DIGEST_LEN + U64.size  # at most, per item
        costs = {i: len(view) + entry for i, (_, view, _) in ready.items()}

        def send(chunk: list[int]) -> int:
            """A frame of at least OVERLAP_HASH_BYTES sends its checksums after the payloads
            (CHECKSUMS_LAST): each value is hashed once it is on its way, while the node receives
            it. A smaller one carries them in its table: hashing it first costs less than the
            node's second wake-up for a trailer sent apart."""
            views = [ready[i][1] for i in chunk]
            size = sum(map(len, views))
            if any(type(view) is DeviceView for view in views):
                return self._send_put_staged(chunk, ready, views, size)
            last = size >= OVERLAP_HASH_BYTES
            table = b"".join(
                put_entry(ready[i][0], ready[i][2], len(view), 0 if last else _checksum(view))
                for i, view in zip(chunk, views)
            )
            trailer = U64.size * len(chunk) if last else 0
            request_id = self._send(
                Op.PUT, len(chunk), table, views, body_extra=size + trailer, flags=FLAG_CHECKSUMS_LAST if last else 0
            )
            if last:
                self._sock.sendall(struct.pack(f"<{len(chunk)}Q", *map(_checksum, views)))
            return request_id

        def receive(chunk: list[int], request_id: int) -> None:
            self._statuses(Op.PUT, chunk, request_id, results)
            for i in chunk:
                results[i] = None if results[i] == Status.OK else error_for(results[i])

        chunks = _split(list(ready), costs, self.max_frame_bytes, self.max_items)
        if wait:
            self._pipeline(chunks, send, receive)
            return
        with self._stream():
            for chunk in chunks:
                self._defer(
                    send(chunk),
                    [ready[i][0] for i in chunk],
                    lambda request_id, n=len(chunk): self._status_list(Op.PUT, request_id, n),  # noqa: B008
                )

    def _send_put_staged(self, chunk: list[int], ready: dict[int, tuple], views: list, size: int) -> int:
        """Send a PUT frame with values in device memory: always CHECKSUMS_LAST, each device value
        copied to pinned staging a chunk ahead of the socket and hashed as it is sent
        (``kvstore_client.cuda.send_from``), host values sent and hashed as they are."""
        table = b"".join(put_entry(ready[i][0], ready[i][2], len(view), 0) for i, view in zip(chunk, views))
        request_id = self._send(
            Op.PUT, len(chunk), table, body_extra=size + U64.size * len(chunk), flags=FLAG_CHECKSUMS_LAST
        )
        checksums = []
        for view in views:
            if type(view) is DeviceView:
                hasher = ValueHasher(len(view))
                send_from(self._sock, view, hasher)
                checksums.append(hasher.intdigest())
            else:
                self._sock.sendall(view)
                checksums.append(_checksum(view))
        self._sock.sendall(struct.pack(f"<{len(chunk)}Q", *checksums))
        return request_id

    def _statuses(self, op: int, chunk: list[int], request_id: int, out: list) -> None:
        """Read a reply of one status byte per item into ``out[i]`` for i in chunk."""
        if self._reply(op, request_id, len(chunk)) != len(chunk):
            raise ProtocolError("status reply body_len does not match its count")
        for i, status in zip(chunk, bytes(self._reader.read(len(chunk)))):
            out[i] = status

    def _status_list(self, op: int, request_id: int, count: int) -> list[int]:
        """The statuses of a reply of one status byte per item."""
        out = [0] * count
        self._statuses(op, list(range(count)), request_id, out)
        return out

    def put(self, key: BlockKey, value, depth: int = 0, wait: bool = True) -> None:
        error = self.put_many([(key, value, depth)], wait)[0]
        if error is not None:
            raise error

    def pull_many(self, source: str, items) -> list[bool]:
        """Have this node copy ``(key, depth)`` items from the node whose data plane is at
        ``source`` ("host:port"), node to node, the bytes never passing through this process:
        True where copied, False where the source holds no such block. Raises the first other
        per-item error (ServiceUnavailable: the source could not be reached), after all items."""
        address = source.encode()
        if not 0 < len(address) < 256:
            raise InvalidValue("a source address is 1..255 bytes")
        items = [(check_key(k), d) for k, d in items]
        statuses: list = [Status.NOT_FOUND] * len(items)

        def send(chunk: list[int]) -> int:
            table = bytes([len(address)]) + address + b"".join([pull_entry(*items[i]) for i in chunk])
            return self._send(Op.PULL, len(chunk), table)

        chunks = _split(list(range(len(items))), [0] * len(items), 1, self.keys_per_frame)
        self._pipeline(chunks, send, lambda chunk, rid: self._statuses(Op.PULL, chunk, rid, statuses))
        return _found(statuses)

    # -- lookups and removal ------------------------------------------------------------------------
    def verify_many(self, keys) -> list[bool | None]:
        """Ask the node to check its copies of ``keys`` whole (VERIFY), because bytes read from
        them did not match: True intact, False damaged (the node dropped it), None absent."""
        keys = [check_key(k) for k in keys]
        verdict: dict[int, bool | None] = {Status.OK: True, Status.CHECKSUM_MISMATCH: False, Status.NOT_FOUND: None}
        return [verdict.get(s) for s in self._item_statuses(Op.VERIFY, keys)]

    def exists_many(self, keys) -> list[bool]:
        return self._flags(Op.EXISTS, keys)

    def remove_many(self, keys) -> list[bool]:
        """Drop each block from every tier of the node; True where one was stored."""
        return self._flags(Op.REMOVE, keys)

    def _flags(self, op: int, keys) -> list[bool]:
        return _found(self._item_statuses(op, [check_key(k) for k in keys]))

    def _item_statuses(self, op: int, keys: list) -> list[int]:
        """A keys-only request (EXISTS, REMOVE, VERIFY): one status per key."""
        statuses: list = [Status.NOT_FOUND] * len(keys)
        chunks = _split(list(range(len(keys))), [0] * len(keys), 1, self.keys_per_frame)
        self._pipeline(
            chunks,
            lambda chunk: self._keys_request(op, keys, chunk),
            lambda chunk, rid: self._statuses(op, chunk, rid, statuses),
        )
        return statuses

    def exists(self, key: BlockKey) -> bool:
        return self.exists_many([key])[0]

    def remove(self, key: BlockKey) -> bool:
        return self.remove_many([key])[0]

    # -- node -----------------------------------------------------------------------------------
    def info(self, refresh: bool = False) -> dict:
        """The node's INFO: node_id, machine_id, arena, max_block_bytes, max_frame_bytes..."""
        if not refresh:
            return dict(self._info)
        with self._stream():
            body_len = self._reply(Op.INFO, self._send(Op.INFO, 0, b""), 0)
            self._info = json.loads(bytes(self._reader.read(body_len)))
        return dict(self._info)

    def ping(self) -> None:
        with self._stream():
            self._reader.skip(self._reply(Op.PING, self._send(Op.PING, 0, b""), 0))

    def close(self) -> None:
        """Close the connection, after reading the replies of puts sent without waiting."""
        if self._dead is None:
            try:
                self.settle()
            except KVStoreError:  # the connection died meanwhile: put_failures says what
                return
            self._die("closed by the client")

    @property
    def closed(self) -> bool:
        return self._dead is not None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TcpConnection(DataPlaneConnection):
    """Frames over TCP to ``address`` ("host:port"). One per thread."""

    def __init__(
        self,
        address: str,
        *,
        verify: bool = True,
        timeout: float | None = None,
        credentials: Credentials = NO_CREDENTIALS,
        tuning: Tuning = DEFAULT_TUNING,
    ):
        self.address = address
        super().__init__(
            _connect(address, timeout, credentials.client_tls()), verify=verify, credentials=credentials, tuning=tuning
        )


class UnixConnection(DataPlaneConnection):
    """Frames over the node's Unix socket at ``path`` (same host). One per thread."""

    def __init__(
        self,
        path: str,
        *,
        verify: bool = True,
        timeout: float | None = None,
        credentials: Credentials = NO_CREDENTIALS,
        tuning: Tuning = DEFAULT_TUNING,
    ):
        self.path = path
        super().__init__(
            _connect(path if "/" in path else "./" + path, timeout),
            verify=verify,
            credentials=credentials,
            tuning=tuning,
        )


def __getattr__(name: str):
    """``ShmConnection`` and ``ShmLease`` live in kvstore_client.shm (which builds on this module)."""
    if name in ("ShmConnection", "ShmLease"):
        from kvstore_client import shm

        return getattr(shm, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DataPlaneConnection", "ShmConnection", "ShmLease", "TcpConnection", "UnixConnection"]  # noqa: F822 (__getattr__)
