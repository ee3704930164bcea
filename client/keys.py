"""Block keys: (namespace, digest) pairs, validated once at the edge.

A digest is normally the 16-byte chained XXH3-128 hash from
:mod:`kvstore_client.hashing`; engines that hash blocks themselves (vLLM,
SGLang) may pass their own hashes as bytes (1 to 64 bytes), as non-negative or
negative ints (signed 128-bit range), or as hex strings.
"""

from __future__ import annotations

from typing import Iterable

from kvstore_client.errors import InvalidKey

BlockKey = tuple[str, bytes]

MAX_NAMESPACE_LEN = 128
MAX_DIGEST_LEN = 64
_INT_MIN, _INT_MAX = -(1 << 127), (1 << 128) - 1


def digest_of(h: bytes | bytearray | memoryview | int | str) -> bytes:
    """Normalise one engine-supplied block hash to digest bytes."""
    if isinstance(h, bytes):
        digest = h
    elif isinstance(h, (bytearray, memoryview)):
        digest = bytes(h)
    elif isinstance(h, bool):
        raise InvalidKey("a block hash cannot be a bool")
    elif isinstance(h, int):
        if not _INT_MIN <= h <= _INT_MAX:
            raise InvalidKey(f"integer block hash {h} does not fit in 128 bits")
        digest = h.to_bytes(16, "little", signed=h < 0)
    elif isinstance(h, str):
        try:
            digest = bytes.fromhex(h)
        except ValueError:
            raise InvalidKey(f"string block hash must be hex, got {h[:40]!r}") from None
    else:
        raise InvalidKey(f"block hash must be bytes, int or hex str, not {type(h).__name__}")
    if not 0 < len(digest) <= MAX_DIGEST_LEN:
        raise InvalidKey(f"block hash must be 1..{MAX_DIGEST_LEN} bytes, got {len(digest)}")
    return digest


def check_namespace(namespace: str) -> str:
    """Return the namespace if it is a usable name, else raise InvalidKey."""
    if not isinstance(namespace, str) or not namespace:
        raise InvalidKey("namespace must be a non-empty str")
    if len(namespace.encode()) > MAX_NAMESPACE_LEN:
        raise InvalidKey(f"namespace longer than {MAX_NAMESPACE_LEN} bytes")
    if "\0" in namespace:
        raise InvalidKey("namespace may not contain NUL")
    return namespace


def make_key(namespace: str, h: bytes | int | str) -> BlockKey:
    """Build a validated key from a namespace and one block hash."""
    return (check_namespace(namespace), digest_of(h))


def make_keys(namespace: str, hashes: Iterable[bytes | int | str]) -> list[BlockKey]:
    """Build validated keys for a chain of engine-supplied block hashes."""
    ns = check_namespace(namespace)
    return [(ns, digest_of(h)) for h in hashes]


def check_key(key: object) -> BlockKey:
    """Validate a key handed to a store; return it unchanged when valid.

    The fast path accepts exactly ``(str, bytes)`` with sane lengths, which is
    what make_key and the hasher produce.
    """
    if type(key) is tuple and len(key) == 2:
        ns, digest = key
        if type(ns) is str and type(digest) is bytes and 0 < len(digest) <= MAX_DIGEST_LEN:
            if ns and ns.isascii() and len(ns) <= MAX_NAMESPACE_LEN and "\0" not in ns:
                return key
            check_namespace(ns)
            return key
        raise InvalidKey(f"malformed key {key!r:.80}: want (namespace str, 1..{MAX_DIGEST_LEN} digest bytes)")
    raise InvalidKey(f"a key is a (namespace, digest) tuple, not {type(key).__name__}")
