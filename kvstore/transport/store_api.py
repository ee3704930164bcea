"""What the data plane needs from the store it serves: the interface, not the class.

The transport serves any object shaped like ``ServedStore``; the node's
:class:`kvstore.node.store.BlockStore` is the one it is given (``kvstore.node.daemon``
wires them). Defined here, on the transport's side, so the transport never imports the
node package: the node sits above it and hands its store in.

Each protocol lists only what the ops, the connections, the server and the puller call;
the store's own documentation says what the calls do and what is thread-safe (all of it).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Iterable, Protocol

from kvstore_client.keys import BlockKey


class StoreLimits(Protocol):
    """The part of the store's configuration the data plane reads."""

    max_block_bytes: int
    connections: object  # a kvstore.transport.limits.ConnectionLimits


class SharedArena(Protocol):
    name: str
    path: str
    size: int
    pages: str


class Directory(Protocol):
    name: str

    def beat(self, lifetime: float) -> None: ...


class SharedDram(Protocol):
    """The DRAM tier as a same-host reader sees it: the arena same-host clients map, and
    the block directory they read without a round trip (None when there is none)."""

    arena: SharedArena
    directory: Directory | None


class ReadLease(Protocol):
    """A DRAM block pinned in place until ``release``."""

    key: BlockKey
    offset: int
    size: int
    checksum: int
    view: memoryview

    def release(self) -> None: ...


class WritableBlock(Protocol):
    """DRAM reserved for one block (a two-phase put): write ``buffer``, then commit or revoke."""

    key: BlockKey | None
    size: int
    buffer: memoryview

    @property
    def open(self) -> bool: ...

    @property
    def offset(self) -> int: ...

    def bind(self, key: BlockKey, depth: int = 0) -> None: ...

    def commit(self, expected_checksum: int | None = None) -> None: ...

    def commit_written(self, checksum: int) -> None: ...

    def revoke(self) -> None: ...


class ServedStore(Protocol):
    """The block store, as the data plane uses it."""

    config: StoreLimits
    dram: SharedDram

    def check_key(self, key: BlockKey) -> BlockKey: ...

    def lease(self, key: BlockKey) -> ReadLease | None: ...

    def get(self, key: BlockKey) -> bytes | None: ...

    def exists(self, key: BlockKey) -> bool: ...

    def check(self, key: BlockKey) -> bool | None: ...

    def touch(self, keys: Iterable[BlockKey]) -> None: ...

    def remove(self, key: BlockKey) -> bool: ...

    def reserve(self, key: BlockKey, size: int, *, depth: int = 0) -> WritableBlock: ...

    def grant(self, size: int) -> WritableBlock: ...

    def request(self) -> AbstractContextManager[None]: ...
