"""The node's half of data-plane authentication: the AUTH op (spec: proto/dataplane.md).

A node given an access file answers nothing but AUTH until a connection has
proven its token (``kvstore_client.auth`` has the exchange). A hello naming a
key id the file does not hold is answered like any other, with a fresh
nonce, and fails at the proof: a caller cannot probe which ids exist. A node
without an access file answers a hello with an empty body (no token needed).
"""

from __future__ import annotations

import hmac
import secrets
from typing import TYPE_CHECKING

from kvstore_client.auth import HELLO_BYTES, KEY_ID_BYTES, NODE_NONCE_BYTES, PROOF_BYTES, DataKey
from kvstore_client.errors import ProtocolError
from kvstore_client.wire import Status

if TYPE_CHECKING:
    from kvstore.transport.connection import Connection, Frame


class PendingProof:
    """A hello answered, its proof not yet checked."""

    __slots__ = ("key", "principal", "client_nonce", "node_nonce")

    def __init__(self, key: DataKey, principal, client_nonce: bytes):
        self.key, self.principal, self.client_nonce = key, principal, client_nonce
        self.node_nonce = secrets.token_bytes(NODE_NONCE_BYTES)


def op_auth(conn: "Connection", frame: "Frame") -> None:
    access = conn.server.access
    pending = conn.pending_proof
    expected = PROOF_BYTES if pending is not None else HELLO_BYTES
    if frame.body_len != expected:
        raise ProtocolError(f"AUTH body of {frame.body_len} bytes; expected {expected}", Status.BAD_FRAME)
    body = bytes(conn.reader.read(frame.body_len))
    if access is None:  # no tokens checked here: say so
        conn.reply(frame, 0, b"")
        return
    if pending is None:
        if conn.principal is not None:
            raise ProtocolError("AUTH again on an authenticated connection", Status.BAD_FRAME)
        found = access.data_key(body[:KEY_ID_BYTES])
        key, principal = found if found is not None else (DataKey(secrets.token_bytes(32)), None)
        conn.pending_proof = pending = PendingProof(key, principal, body[KEY_ID_BYTES:])
        conn.reply(frame, 0, pending.node_nonce)
        return
    conn.pending_proof = None
    good = hmac.compare_digest(body, pending.key.client_proof(pending.client_nonce, pending.node_nonce))
    if not good or pending.principal is None:
        raise ProtocolError("token refused", Status.UNAUTHENTICATED)
    conn.authenticated(pending.principal, pending.key)
    conn.reply(
        frame, 0, pending.key.node_proof(pending.client_nonce, pending.node_nonce) + pending.principal.name.encode()
    )
