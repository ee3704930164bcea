"""kvstore_client: the SDK an inference engine imports.

``Client`` / ``AsyncClient`` talk to a kvstore pool; ``BlockHasher`` turns
tokens into chained block keys; every error is a ``KVStoreError``. The
clients load on first use, so importing the package for keys and hashing
stays cheap (no gRPC).
"""

from kvstore_client.errors import (
    BufferTooSmall,
    CapacityError,
    ChecksumMismatch,
    ClientClosed,
    ConfigError,
    DeviceUnavailable,
    InvalidKey,
    InvalidValue,
    KVStoreError,
    LayoutMismatch,
    Overloaded,
    PermissionDenied,
    ProtocolError,
    PutFailed,
    QuotaExceeded,
    RemoteError,
    ReservationError,
    ServiceUnavailable,
    TransportError,
    Unauthenticated,
    UnknownNamespace,
)
from kvstore_client.hashing import BlockHasher, chain_hashes, namespace_name, namespace_seed
from kvstore_client.keys import BlockKey, make_key, make_keys

__all__ = [
    "AsyncClient",
    "BlockHasher",
    "BlockKey",
    "BufferTooSmall",
    "CapacityError",
    "Client",
    "ClientClosed",
    "ChecksumMismatch",
    "ConfigError",
    "DeviceUnavailable",
    "InvalidKey",
    "InvalidValue",
    "KVStoreError",
    "LayoutMismatch",
    "Overloaded",
    "PermissionDenied",
    "PrefixMatch",
    "ProtocolError",
    "PutFailed",
    "QuotaExceeded",
    "RemoteError",
    "ReservationError",
    "ServiceUnavailable",
    "TransportError",
    "Unauthenticated",
    "UnknownNamespace",
    "chain_hashes",
    "make_key",
    "make_keys",
    "namespace_name",
    "namespace_seed",
]


def __getattr__(name: str):
    if name in ("Client", "PrefixMatch"):
        from kvstore_client import client

        return getattr(client, name)
    if name == "AsyncClient":
        from kvstore_client.aio import AsyncClient

        return AsyncClient
    raise AttributeError(f"module 'kvstore_client' has no attribute {name!r}")
