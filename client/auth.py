"""Tokens: what a caller presents to the master (gRPC) and to nodes (the data plane).

A token is an opaque secret string from the service's access file. On gRPC it
travels as ``authorization: Bearer <token>`` metadata on every call (use TLS
on links others can read). On the data plane it never travels: the first
frames of a connection are a challenge-response keyed by ``sha256(token)``
(spec: proto/dataplane.md, Authentication):

    client -> AUTH  key_id (16 bytes) + client nonce (16)
    node   -> AUTH  node nonce (32)        (empty: the node checks no tokens)
    client -> AUTH  client proof (32)
    node   -> AUTH  node proof (32) + the token's name (UTF-8)

Each proof is an HMAC-SHA256 under the key over both nonces, so neither side
learns anything it could replay, and the client knows it talks to a node
that holds the access file.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass

from kvstore_client.errors import Unauthenticated

TOKEN_ENV = "KVSTORE_TOKEN"
BEARER_METADATA = "authorization"
KEY_ID_BYTES = CLIENT_NONCE_BYTES = 16
NODE_NONCE_BYTES = PROOF_BYTES = 32
HELLO_BYTES = KEY_ID_BYTES + CLIENT_NONCE_BYTES
_CLIENT_PROOF, _NODE_PROOF = b"kvstore data plane v1: client", b"kvstore data plane v1: node"


def resolve_token(token: str | None) -> str | None:
    """``token``, else the KVSTORE_TOKEN environment variable, else None (no token)."""
    if token is None:
        token = os.environ.get(TOKEN_ENV) or None
    if token is not None and (not isinstance(token, str) or not token.strip()):
        raise Unauthenticated("a token must be a non-empty string")
    return token.strip() if token is not None else None


def bearer_metadata(token: str) -> tuple[str, str]:
    """The gRPC metadata pair that carries ``token``."""
    return (BEARER_METADATA, f"Bearer {token}")


def token_from_metadata(metadata) -> str | None:
    """The bearer token of a call's invocation metadata (None: none sent)."""
    for key, value in metadata or ():
        if key == BEARER_METADATA and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer ") :]
    return None


@dataclass(frozen=True)
class DataKey:
    """The data-plane key of one token: ``sha256(token)``, named by ``key_id`` (which reveals
    nothing of the key)."""

    key: bytes

    @classmethod
    def of_token(cls, token: str) -> "DataKey":
        return cls(hashlib.sha256(token.encode()).digest())

    @property
    def key_id(self) -> bytes:
        return hashlib.sha256(b"kvstore key id\0" + self.key).digest()[:KEY_ID_BYTES]

    def client_proof(self, client_nonce: bytes, node_nonce: bytes) -> bytes:
        return self._mac(_CLIENT_PROOF, client_nonce, node_nonce)

    def node_proof(self, client_nonce: bytes, node_nonce: bytes) -> bytes:
        return self._mac(_NODE_PROOF, client_nonce, node_nonce)

    def _mac(self, label: bytes, client_nonce: bytes, node_nonce: bytes) -> bytes:
        return hmac.new(self.key, label + self.key_id + client_nonce + node_nonce, hashlib.sha256).digest()


class Handshake:
    """The client's half of the data-plane challenge-response, for one connection."""

    def __init__(self, key: DataKey):
        self.key = key
        self.client_nonce = secrets.token_bytes(CLIENT_NONCE_BYTES)
        self._node_nonce = b""

    def hello(self) -> bytes:
        return self.key.key_id + self.client_nonce

    def challenge(self, body: bytes) -> bytes | None:
        """The proof that answers the node's reply to hello; None when the node checks no tokens."""
        if not body:
            return None
        if len(body) != NODE_NONCE_BYTES:
            raise Unauthenticated(f"the node's challenge has {len(body)} bytes, not {NODE_NONCE_BYTES}")
        self._node_nonce = bytes(body)
        return self.key.client_proof(self.client_nonce, self._node_nonce)

    def accepted(self, body: bytes) -> str:
        """Check the node's proof; the token's name, as the node knows it."""
        proof, name = bytes(body[:PROOF_BYTES]), bytes(body[PROOF_BYTES:])
        if not hmac.compare_digest(proof, self.key.node_proof(self.client_nonce, self._node_nonce)):
            raise Unauthenticated("the node could not prove it holds this token: not the node it claims to be")
        return name.decode(errors="replace")
