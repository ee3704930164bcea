"""Chained block hashing: the key of a block names its whole prefix.

    h_0 = XXH3_128(b"kvstore/v1" ‖ 0x00 ‖ namespace as UTF-8)
    h_i = XXH3_128(h_{i-1} ‖ tokens of block i as little-endian u32 ‖ extra_i)

Digests are XXH3-128's canonical 16 bytes. No per-process seed is involved,
so every process on every machine derives the same keys. Only full blocks
are hashed: a trailing partial block has no key.
"""

from __future__ import annotations

import sys
from array import array
from typing import Sequence

import xxhash

from kvstore_client.errors import InvalidKey
from kvstore_client.keys import BlockKey, check_namespace

_SALT_PREFIX = b"kvstore/v1\0"
_xxh3_128_digest = xxhash.xxh3_128_digest


def namespace_name(model: str, *, tenant: str = "", lora: str = "", cache_salt: str = "") -> str:
    """Canonical namespace for a model plus optional tenant, LoRA adapter and cache salt.

    Blocks of two namespaces never share keys, so KV computed under one LoRA
    or tenant salt is never served to another.
    """
    parts = [model, tenant, lora, cache_salt]
    if any("|" in p for p in parts):
        raise InvalidKey("namespace parts may not contain '|'")
    while parts and not parts[-1]:
        parts.pop()
    return check_namespace("|".join(parts))


def namespace_seed(namespace: str) -> bytes:
    """h_0 of every chain in ``namespace``."""
    return _xxh3_128_digest(_SALT_PREFIX + check_namespace(namespace).encode())


def _tokens_le_u32(tokens: Sequence[int]) -> memoryview:
    """Tokens as a flat little-endian u32 byte view, without a per-token Python loop."""
    if hasattr(tokens, "__array_interface__") or type(tokens).__module__.startswith("torch"):
        import numpy as np  # numpy arrays and tensors: one vectorised cast

        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise InvalidKey("tokens must be one-dimensional")
        if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
            raise InvalidKey("token ids must fit in an unsigned 32-bit integer")
        # an ndarray is a buffer; numpy's stubs declare its __buffer__ only from Python 3.12 on
        return memoryview(np.ascontiguousarray(arr, dtype="<u4")).cast("B")  # type: ignore[arg-type]
    try:
        buf = array("I", tokens)
    except (OverflowError, TypeError) as exc:
        raise InvalidKey(f"token ids must be ints in 0..2**32-1: {exc}") from None
    if buf.itemsize != 4:  # pragma: no cover - no such platform in use
        buf = array("L", tokens)
    if sys.byteorder == "big":  # pragma: no cover
        buf.byteswap()
    return memoryview(buf).cast("B")


def chain_hashes(
    tokens: Sequence[int],
    block_size: int,
    namespace: str,
    *,
    parent: bytes | None = None,
    extras: Sequence[bytes] | None = None,
) -> list[bytes]:
    """Digests of every full block of ``tokens``.

    ``parent`` continues a chain (the digest of the block before ``tokens``);
    ``extras`` adds per-block bytes (e.g. multimodal input hashes) to each link.
    """
    if block_size <= 0:
        raise InvalidKey("block_size must be positive")
    data = _tokens_le_u32(tokens)
    stride = 4 * block_size
    n_blocks = len(data) // stride
    if extras is not None and len(extras) < n_blocks:
        raise InvalidKey(f"{n_blocks} full blocks but only {len(extras)} extras")
    prev = namespace_seed(namespace) if parent is None else parent
    out = []
    digest = _xxh3_128_digest
    for i in range(n_blocks):
        chunk = data[i * stride : (i + 1) * stride]
        link = prev + chunk if extras is None else prev + chunk + bytes(extras[i])
        prev = digest(link)
        out.append(prev)
    return out


class BlockHasher:
    """Turns token sequences into the block keys of one namespace.

    Stateless apart from its settings, so one instance may be shared by threads.
    """

    def __init__(self, namespace: str, block_size: int):
        if block_size <= 0:
            raise InvalidKey("block_size must be positive")
        self.namespace = check_namespace(namespace)
        self.block_size = block_size

    def hashes(self, tokens: Sequence[int], *, parent: bytes | None = None) -> list[bytes]:
        """Digests of every full block of ``tokens``."""
        return chain_hashes(tokens, self.block_size, self.namespace, parent=parent)

    def keys(self, tokens: Sequence[int], *, parent: bytes | None = None) -> list[BlockKey]:
        """Store keys of every full block of ``tokens``, in chain order."""
        ns = self.namespace
        return [(ns, h) for h in self.hashes(tokens, parent=parent)]
