"""The conductor port's frame format, shared by the master and its clients (spec: ``proto/conductor.md``).

The conductor port carries a router's per-request calls (``Schedule`` and ``ReportRequest``) on a
plain framed TCP connection, where each gRPC call from Python costs one to two milliseconds of
thread hand-offs. Bodies are the very protobuf messages of the gRPC methods; this module is the
codec: the header, the method and status codes, and the typed error of each status. It opens
no connections.
"""

from __future__ import annotations

import struct
from enum import IntEnum

from google.protobuf.message import Message

from kvstore_client.errors import (
    InvalidValue,
    KVStoreError,
    Overloaded,
    PermissionDenied,
    ProtocolError,
    ServiceUnavailable,
    Unauthenticated,
)
from kvstore_client.proto import kvstore_pb2 as pb

MAGIC = b"KC"
VERSION = 1
HEADER = struct.Struct("<2sBBII")  # magic, version, method (request) or status (reply), request_id, body_len
HEADER_SIZE = HEADER.size  # 12
MAX_BODY_BYTES = 4 << 20  # a Schedule of a ~100k-block prompt; a larger header ends the connection
MAX_TOKEN_BYTES = 4096  # an AUTH body


class Method(IntEnum):
    AUTH = 1  # body: the token (UTF-8); reply: the token's name. First, when the master checks tokens
    SCHEDULE = 2  # body: ScheduleRequest; reply: ScheduleReply
    REPORT_REQUEST = 3  # body: RequestEvent; reply: RequestEventReply


class Status(IntEnum):
    OK = 0
    REJECTED = 1  # Schedule turned the request away: the body is a ScheduleReply with reason and detail
    INVALID = 2
    UNAUTHENTICATED = 3  # the connection is closed after it
    PERMISSION_DENIED = 4
    UNAVAILABLE = 5  # not the leader (masters on etcd), or stopping
    BAD_FRAME = 6  # the byte stream cannot be trusted: the connection is closed after it
    INTERNAL = 7
    BUSY = 8  # too many connections: this one is closed


#: what each method's request and reply body decode as
BODIES: dict[Method, tuple[type[Message], type[Message]]] = {
    Method.SCHEDULE: (pb.ScheduleRequest, pb.ScheduleReply),
    Method.REPORT_REQUEST: (pb.RequestEvent, pb.RequestEventReply),
}
#: the gRPC method whose roles (security.grpc_gate.METHOD_ROLES) and metrics each method shares
GRPC_NAMES = {Method.SCHEDULE: "Conductor/Schedule", Method.REPORT_REQUEST: "Conductor/ReportRequest"}

_ERRORS: dict[int, type[KVStoreError]] = {
    Status.INVALID: InvalidValue,
    Status.UNAUTHENTICATED: Unauthenticated,
    Status.PERMISSION_DENIED: PermissionDenied,
    Status.UNAVAILABLE: ServiceUnavailable,
    Status.BAD_FRAME: ProtocolError,
    Status.BUSY: ServiceUnavailable,
}


def pack_header(code: int, request_id: int, body_len: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, code, request_id, body_len)


def unpack_header(data) -> tuple[int, int, int]:
    """(method or status, request_id, body_len); ProtocolError for a header that is not one."""
    magic, version, code, request_id, body_len = HEADER.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(f"not a conductor frame (magic {bytes(magic)!r})")
    if version != VERSION:
        raise ProtocolError(f"conductor frame version {version}; this side speaks {VERSION}")
    if body_len > MAX_BODY_BYTES:
        raise ProtocolError(f"conductor frame body of {body_len} bytes; at most {MAX_BODY_BYTES}")
    return code, request_id, body_len


def error_of(status: int, body: bytes, method: str = "") -> KVStoreError:
    """The typed error a reply's status and body stand for (a rejection is Overloaded with its reason)."""
    where = f"{method}: " if method else ""
    if status == Status.REJECTED:
        reply = pb.ScheduleReply.FromString(body)
        return Overloaded(f"{where}{reply.reason}: {reply.detail}", reply.reason)
    text = body.decode("utf-8", "replace")
    kind = _ERRORS.get(status, KVStoreError)
    return kind(f"{where}{text}" if status in _ERRORS else f"{where}conductor port error {status}: {text}")
