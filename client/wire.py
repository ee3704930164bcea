"""The data-plane wire format shared by SDK clients and storage nodes.

Spec: ``proto/dataplane.md``. This module is the codec: frame and table
layouts, status codes and their typed errors, key entry encoding/decoding,
plus two duck-typed stream helpers (``FrameReader`` over anything with
``recv_into``, ``send_buffers`` over anything with ``sendmsg``). It opens no
connections and holds no shared state; everything here is thread-safe except
a FrameReader, which belongs to one connection.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from enum import IntEnum
from functools import lru_cache

from kvstore_client.errors import (
    CapacityError,
    ChecksumMismatch,
    ConfigError,
    InvalidKey,
    InvalidValue,
    KVStoreError,
    PermissionDenied,
    ProtocolError,
    QuotaExceeded,
    RemoteError,
    ReservationError,
    SameHostSpaceFull,
    ServiceUnavailable,
    TransportError,
    Unauthenticated,
    UnknownNamespace,
)
from kvstore_client.keys import MAX_DIGEST_LEN, BlockKey, check_key

MAGIC = b"KV"
VERSION = 1
HEADER = struct.Struct("<2sBBHHIIQ")  # magic, version, op, status, flags, request_id, count, body_len
HEADER_SIZE = HEADER.size  # 24
MAX_ITEMS = 65536  # items in one frame
MAX_ENTRY_BYTES = 22 + 255 + 255  # largest table entry (a PUT entry with maximal lengths)
MAX_TABLE_BYTES = MAX_ITEMS * MAX_ENTRY_BYTES  # bound on a frame's item table

# Table layouts (all little-endian).
KEY_HEAD = struct.Struct("<BB")  # ns_len, dg_len; then namespace UTF-8, digest
PUT_ENTRY = struct.Struct("<BBIQQ")  # ns_len, dg_len, depth, size, checksum; then ns, digest
RESERVE_ENTRY = struct.Struct("<BBIQ")  # ns_len, dg_len, depth, size; then ns, digest
GET_ITEM = struct.Struct("<BQQ")  # reply: status, size, checksum
LEASE_ITEM = struct.Struct("<BQQQ")  # reply: status, offset, size, checksum
RESERVED_ITEM = struct.Struct("<BQ")  # reply: status, offset
PULL_ENTRY = struct.Struct("<BBI")  # ns_len, dg_len, depth; then ns, digest
RANGE_ENTRY = struct.Struct("<BBII")  # ns_len, dg_len, first slice, slices; then ns, digest
RANGE_ITEM = struct.Struct("<BQ")  # reply: status, bytes of the range (after its slices' checksums)
U64 = struct.Struct("<Q")

# Header flags.
FLAG_REPLY = 0x1  # set on every frame a node sends
FLAG_NO_REPLY = 0x2  # RELEASE, TOUCH and COMMIT with ABORT: the node sends nothing back
FLAG_ABORT = 0x4  # COMMIT only: revoke the reservations instead of publishing them
FLAG_HOLD = 0x8  # LEASE only: the leases never expire (held until RELEASE or the connection ends)
FLAG_REGRANT = 0x10  # COMMIT and STORE: also grant the same sizes again, for the next STORE
FLAG_WRITTEN = 0x20  # COMMIT only: the checksums are the writer's, over its own source: recorded, not re-read
FLAG_CHECKSUMS_LAST = 0x40  # PUT only: the table's checksums are 0; n x u64 checksums follow the payloads


class Op(IntEnum):
    ERROR = 0  # reply only: a frame-level error; the node then closes the connection
    PING = 1
    INFO = 2
    GET = 3
    PUT = 4
    EXISTS = 5
    REMOVE = 6
    LEASE = 7
    RELEASE = 8
    RESERVE = 9
    COMMIT = 10
    TOUCH = 11
    PULL = 12
    STORE = 13
    VERIFY = 14
    AUTH = 15  # the first frames of a connection to a node with an access file (kvstore_client.auth)
    GET_RANGES = 16  # slices of sliced values (kvstore_client.slices), each checked on its own


class Status(IntEnum):
    OK = 0
    NOT_FOUND = 1
    INVALID_KEY = 2
    INVALID_VALUE = 3  # empty or larger than max_block_bytes
    UNKNOWN_NAMESPACE = 4
    NO_CAPACITY = 5
    CHECKSUM_MISMATCH = 6
    BAD_FRAME = 7
    FRAME_TOO_LARGE = 8  # frame level: body_len/count over the limit; GET item: not sent, ask again
    UNSUPPORTED = 9  # unknown version or op
    UNKNOWN_LEASE = 10  # unknown lease or reservation id
    NOT_IN_DRAM = 11  # LEASE item stored but not in DRAM: read it with GET
    INTERNAL = 12
    SOURCE_UNAVAILABLE = 13  # PULL item: the source node could not be reached, or failed mid-transfer
    SAME_HOST_ONLY = 14  # frame: an op that holds node memory (RESERVE, COMMIT, STORE, LEASE) over TCP
    BUSY = 15  # frame: the node serves its maximum of connections; try again later
    UNAUTHENTICATED = 16  # frame: no valid token (a request before AUTH, or a wrong proof)
    PERMISSION_DENIED = 17  # item: another tenant's namespace; frame: an op the token may not use
    QUOTA_EXCEEDED = 18  # item: the tenant holds its quota of bytes
    SAME_HOST_FULL = 19  # RESERVE item: the node's space for same-host writers is held: send it with PUT
    EXPIRED = 20  # COMMIT item: its reservation outlived the node's write_ttl and was revoked


# Requests that carry keys: op -> the layout of their table entries (ns_len, dg_len first; the
# namespace and digest last). PULL's table follows its source address, STORE's its grant id.
# Every other op but ERROR (reply only) carries no key: KEYLESS_OPS.
KEYED_OPS: dict[int, struct.Struct] = {
    Op.GET: KEY_HEAD,
    Op.PUT: PUT_ENTRY,
    Op.EXISTS: KEY_HEAD,
    Op.REMOVE: KEY_HEAD,
    Op.LEASE: KEY_HEAD,
    Op.RESERVE: RESERVE_ENTRY,
    Op.TOUCH: KEY_HEAD,
    Op.PULL: PULL_ENTRY,
    Op.STORE: PUT_ENTRY,
    Op.VERIFY: KEY_HEAD,
    Op.GET_RANGES: RANGE_ENTRY,
}
KEYLESS_OPS = frozenset({Op.PING, Op.INFO, Op.RELEASE, Op.COMMIT, Op.AUTH})


_ERROR_CLASSES: dict[int, type[KVStoreError]] = {
    Status.INVALID_KEY: InvalidKey,
    Status.INVALID_VALUE: InvalidValue,
    Status.UNKNOWN_NAMESPACE: UnknownNamespace,
    Status.NO_CAPACITY: CapacityError,
    Status.CHECKSUM_MISMATCH: ChecksumMismatch,
    Status.INTERNAL: RemoteError,
    Status.SOURCE_UNAVAILABLE: ServiceUnavailable,
    Status.BUSY: ServiceUnavailable,
    Status.UNAUTHENTICATED: Unauthenticated,
    Status.PERMISSION_DENIED: PermissionDenied,
    Status.QUOTA_EXCEEDED: QuotaExceeded,
    Status.SAME_HOST_FULL: SameHostSpaceFull,
    Status.EXPIRED: ReservationError,
}
_STATUS_OF = [  # most specific first (the order matters for subclasses)
    (InvalidKey, Status.INVALID_KEY),
    (InvalidValue, Status.INVALID_VALUE),
    (UnknownNamespace, Status.UNKNOWN_NAMESPACE),
    (QuotaExceeded, Status.QUOTA_EXCEEDED),
    (SameHostSpaceFull, Status.SAME_HOST_FULL),
    (CapacityError, Status.NO_CAPACITY),
    (PermissionDenied, Status.PERMISSION_DENIED),
    (Unauthenticated, Status.UNAUTHENTICATED),
    (ChecksumMismatch, Status.CHECKSUM_MISMATCH),
    (ReservationError, Status.EXPIRED),
]


def error_for(status: int, message: str = "") -> KVStoreError:
    """The typed exception for a non-OK wire status (not raised)."""
    try:
        name = Status(status).name
    except ValueError:
        name = f"status {status}"
    message = message or name.lower().replace("_", " ")
    cls = _ERROR_CLASSES.get(status)
    if cls is not None:
        return cls(message)
    if status in (
        Status.BAD_FRAME,
        Status.FRAME_TOO_LARGE,
        Status.UNSUPPORTED,
        Status.UNKNOWN_LEASE,
        Status.SAME_HOST_ONLY,
    ):
        return ProtocolError(message, status)
    return RemoteError(f"{message} ({name})")


def status_of(exc: BaseException) -> int:
    """The wire status for an exception raised while serving a request."""
    if isinstance(exc, ProtocolError):
        return exc.status
    for cls, status in _STATUS_OF:
        if isinstance(exc, cls):
            return status
    return Status.INTERNAL


# -- headers --------------------------------------------------------------------------
def pack_header(op: int, request_id: int, count: int, body_len: int, *, status: int = 0, flags: int = 0) -> bytes:
    return HEADER.pack(MAGIC, VERSION, op, status, flags, request_id, count, body_len)


def unpack_header(data) -> tuple[int, int, int, int, int, int]:
    """(op, status, flags, request_id, count, body_len); ProtocolError on bad magic or version."""
    magic, version, op, status, flags, request_id, count, body_len = HEADER.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}: not a kvstore data-plane frame", Status.BAD_FRAME)
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (this side speaks {VERSION})", Status.UNSUPPORTED)
    return op, status, flags, request_id, count, body_len


# -- key entries ----------------------------------------------------------------------
@lru_cache(maxsize=256)
def _ns_bytes(namespace: str) -> bytes:
    return namespace.encode()


def key_entry(key: BlockKey) -> bytes:
    """A key table entry: u8 ns_len, u8 dg_len, namespace UTF-8, digest."""
    ns, digest = key
    nsb = _ns_bytes(ns)
    return KEY_HEAD.pack(len(nsb), len(digest)) + nsb + digest


def put_entry(key: BlockKey, depth: int, size: int, checksum: int) -> bytes:
    ns, digest = key
    nsb = _ns_bytes(ns)
    return PUT_ENTRY.pack(len(nsb), len(digest), depth, size, checksum) + nsb + digest


def range_entry(key: BlockKey, first: int, count: int) -> bytes:
    ns, digest = key
    nsb = _ns_bytes(ns)
    return RANGE_ENTRY.pack(len(nsb), len(digest), first, count) + nsb + digest


def pull_entry(key: BlockKey, depth: int) -> bytes:
    ns, digest = key
    nsb = _ns_bytes(ns)
    return PULL_ENTRY.pack(len(nsb), len(digest), depth) + nsb + digest


def reserve_entry(key: BlockKey, depth: int, size: int) -> bytes:
    ns, digest = key
    nsb = _ns_bytes(ns)
    return RESERVE_ENTRY.pack(len(nsb), len(digest), depth, size) + nsb + digest


_INVALID_KEY = int(Status.INVALID_KEY)  # a plain int: ops tell statuses from keys by ``type(x) is int``


def decode_key(ns: bytes, digest: bytes) -> BlockKey | int:
    """The key of a table entry, or the int INVALID_KEY (never raises)."""
    if not ns or not 0 < len(digest) <= MAX_DIGEST_LEN:
        return _INVALID_KEY
    try:
        return check_key((ns.decode(), digest))
    except (UnicodeDecodeError, InvalidKey):
        return _INVALID_KEY


def parse_table(body, count: int, fixed: struct.Struct = KEY_HEAD) -> list[tuple]:
    """Parse a table of ``count`` entries that fills ``body`` exactly.

    Each entry is ``fixed`` (whose first two fields are ns_len, dg_len), then
    the namespace and digest. Returns one ``(key or status, fields)`` per entry;
    raises ProtocolError(BAD_FRAME) when the entries do not fill ``body``.
    """
    data = bytes(body)
    out, pos, end, size = [], 0, len(data), fixed.size
    unpack = fixed.unpack_from
    for _ in range(count):
        if pos + size > end:
            raise ProtocolError("item table shorter than its count", Status.BAD_FRAME)
        fields = unpack(data, pos)
        ns_end = pos + size + fields[0]
        dg_end = ns_end + fields[1]
        if dg_end > end:
            raise ProtocolError("key entry runs past the item table", Status.BAD_FRAME)
        out.append((decode_key(data[pos + size : ns_end], data[ns_end:dg_end]), fields))
        pos = dg_end
    if pos != end:
        raise ProtocolError(f"item table has {end - pos} bytes after its {count} entries", Status.BAD_FRAME)
    return out


# -- streams ----------------------------------------------------------------------------
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
_FILL = 16384  # bytes asked for when refilling: small, so little payload is copied through the buffer
# A client waiting for a reply that carries no block polls its socket for up to reply_spin()
# seconds (yielding the CPU between polls) before it sleeps in recv: where an idle CPU halts at
# once (VMs without guest halt-polling, like the one the README's figures come from) a sleep and
# the wake-up the reply then needs cost 20-40 microseconds on each side, as much as the node's
# work on a put. A reply later than that makes the next SPIN_BACKOFF waits sleep at once, so a
# loaded node or CPU is not polled for nothing. Replies with blocks (GET) are not polled for:
# their bytes keep coming for longer, and polling for the first of them cost 40 microseconds of
# CPU per 1 MiB get for no gain in time. Environment: KVSTORE_REPLY_SPIN_US (0: never poll), read
# when a Client is built (Client(reply_spin_us=...) overrides it), or by a connection made on its own
# when it is made; never at import.
DEFAULT_REPLY_SPIN_US = 200.0


def reply_spin() -> float:
    """Seconds a client polls for a reply before sleeping: KVSTORE_REPLY_SPIN_US, else 200 µs."""
    text = os.environ.get("KVSTORE_REPLY_SPIN_US")
    try:
        return max(0.0, float(text)) / 1e6 if text else DEFAULT_REPLY_SPIN_US / 1e6
    except ValueError:
        raise ConfigError(f"KVSTORE_REPLY_SPIN_US must be a number of microseconds, got {text!r}") from None


SPIN_BACKOFF = 8
_DONTWAIT = socket.MSG_DONTWAIT
_perf = time.perf_counter
_yield = os.sched_yield
# A payload of PIECEWISE_FROM bytes or more is received RECV_PIECE bytes per recv, not in one
# MSG_WAITALL call for all of it: 12-17% faster for 1 MiB and 15-23% for 4 MiB over loopback
# TCP here (interleaved A/B through a node, with and without checksums), 7% slower for 512 KiB.
PIECEWISE_FROM = 1 << 20
RECV_PIECE = 64 << 10


class FrameReader:
    """Buffered reads from one stream socket (anything with ``recv_into`` and ``recvmsg_into``).

    ``read(n)`` returns a view of the next n bytes, valid until the next call;
    ``readinto(view)`` fills a caller buffer, copying at most what is already
    buffered and receiving the rest straight into it (``MSG_WAITALL``);
    ``readinto_many`` does the same for a list of buffers with scatter reads.
    EOF raises TransportError. Not thread-safe: one reader per connection.
    ``spin``: seconds ``read(n, poll=True)`` polls for data before it sleeps in
    recv (see reply_spin; 0 for a server, whose threads must not poll).
    """

    def __init__(self, sock, size: int = 65536, spin: float = 0.0):
        self._sock = sock
        self._recv = sock.recv_into
        self._buf = memoryview(bytearray(size))
        self._start = self._end = 0
        self._spin = spin
        self._skip_spins = 0

    @property
    def buffered(self) -> int:
        return self._end - self._start

    def wait(self) -> bool:
        """Block until at least one byte is buffered; False on EOF."""
        if self._end > self._start:
            return True
        got = self._recv(self._buf, _FILL)
        self._start, self._end = 0, got
        return bool(got)

    def read(self, n: int, poll: bool = False) -> memoryview:
        """The next ``n`` bytes (a view valid until the next call); ``poll``: poll for them
        for up to ``spin`` seconds before sleeping in recv (for a reply expected soon)."""
        start, end = self._start, self._end
        if end - start >= n:
            self._start = start + n
            return self._buf[start : start + n]
        if n > len(self._buf):  # rare: a big table, gathered as its bytes arrive
            return self._read_growing(n)
        buf = self._buf
        if start:
            buf[: end - start] = buf[start:end]
            end -= start
        while end < n:
            want = min(len(buf) - end, max(n - end, _FILL))
            got = self._recv_polling(buf[end:], want) if poll and self._spin else self._recv(buf[end:], want)
            if not got:
                self._start = self._end = 0
                raise TransportError("connection closed by peer")
            end += got
        self._start, self._end = n, end
        return buf[:n]

    def _read_growing(self, n: int) -> memoryview:
        """``n`` bytes in a buffer that grows with the bytes received, a buffer-full at a time:
        what a peer announces in a header (up to the frame limits) is never allocated before
        it has sent it."""
        out, chunk = bytearray(), len(self._buf)
        while len(out) < n:
            out += self.read(min(chunk, n - len(out)))
        return memoryview(out)

    def _recv_polling(self, view, n: int) -> int:
        """recv_into, polled for up to ``spin`` seconds first (unless backing off)."""
        if self._skip_spins:
            self._skip_spins -= 1
            return self._recv(view, n)
        recv, deadline = self._recv, _perf() + self._spin
        while True:
            try:
                return recv(view, n, _DONTWAIT)
            except BlockingIOError:
                if _perf() > deadline:
                    self._skip_spins = SPIN_BACKOFF
                    return recv(view, n)
                _yield()

    def readinto(self, view: memoryview, hasher=None) -> None:
        """Fill ``view``. ``hasher`` (an xxhash object), when given, is updated with the bytes
        as they land, a piece at a time while each is still in cache."""
        n = len(view)
        have = min(self._end - self._start, n)
        if have:
            view[:have] = self._buf[self._start : self._start + have]
            self._start += have
            if hasher is not None:
                hasher.update(view[:have])
        piece = RECV_PIECE if n >= PIECEWISE_FROM else n
        while have < n:
            want = min(piece, n - have)
            got = self._recv(view[have : have + want], want, socket.MSG_WAITALL)
            if not got:
                raise TransportError("connection closed by peer mid-frame")
            if hasher is not None:
                hasher.update(view[have : have + got])
            have += got

    def readinto_many(self, views: list) -> None:
        """Fill each view in turn (a scatter read: one ``recvmsg_into`` for many buffers)."""
        i, n = 0, len(views)
        while i < n and self._end > self._start:  # what is buffered goes first
            self.readinto(views[i])
            i += 1
        views = [v for v in views[i:] if len(v)]
        i, n = 0, len(views)
        recvmsg_into = self._sock.recvmsg_into
        while i < n:
            got = recvmsg_into(views[i : i + IOV_MAX], 0, socket.MSG_WAITALL)[0]
            if not got:
                raise TransportError("connection closed by peer mid-frame")
            while i < n and got >= len(views[i]):
                got -= len(views[i])
                i += 1
            if got:
                views[i] = views[i][got:]

    def skip(self, n: int) -> None:
        """Consume and drop ``n`` bytes."""
        while n:
            chunk = min(n, len(self._buf))
            self.read(chunk)
            n -= chunk


def send_buffers(sock, buffers: list) -> None:
    """Send every buffer in order with as few ``sendmsg`` calls as possible (partial sends handled)."""
    views = [b if isinstance(b, memoryview) else memoryview(b) for b in buffers]
    i, n = 0, len(views)
    while i < n:
        sent = sock.sendmsg(views[i : i + IOV_MAX])
        while sent:
            size = views[i].nbytes
            if sent >= size:
                sent -= size
                i += 1
            else:
                views[i] = views[i][sent:]
                sent = 0
        while i < n and not views[i].nbytes:
            i += 1
