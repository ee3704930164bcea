"""kvstore_client: the SDK an inference engine imports.

Today it holds block keys, chained block hashing and the typed errors shared
with the server; the networked Client arrives with the cluster service.
"""

from kvstore_client.errors import (
    BufferTooSmall,
    CapacityError,
    ChecksumMismatch,
    ConfigError,
    InvalidKey,
    InvalidValue,
    KVStoreError,
    ReservationError,
    UnknownNamespace,
)
from kvstore_client.hashing import BlockHasher, chain_hashes, namespace_name, namespace_seed
from kvstore_client.keys import BlockKey, make_key, make_keys

__all__ = [
    "BlockHasher",
    "BlockKey",
    "BufferTooSmall",
    "CapacityError",
    "ChecksumMismatch",
    "ConfigError",
    "InvalidKey",
    "InvalidValue",
    "KVStoreError",
    "ReservationError",
    "UnknownNamespace",
    "chain_hashes",
    "make_key",
    "make_keys",
    "namespace_name",
    "namespace_seed",
]
