"""AsyncClient: the Client's calls for asyncio code.

Each call runs the blocking Client call in a worker thread
(``asyncio.to_thread``), so the event loop never waits on a socket or a copy.
The data plane is bulk memory traffic that releases the GIL in the kernel, so
threads serve it as well as a native asyncio transport would, and one code
path stays the source of truth.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Sequence

from kvstore_client.client import Client, PrefixMatch
from kvstore_client.hashing import BlockHasher
from kvstore_client.keys import BlockKey


class AsyncClient:
    """Async twin of Client; same arguments, same results, awaitable (and the same errors:
    every call after ``close()`` raises ClientClosed). Its keyword arguments are Client's,
    tuning included (``inspect.signature(AsyncClient)`` shows them)."""

    def __init__(self, master: str, **options: Any):
        self._client = Client(master, **options)

    # Client's signature, for help() and inspect (the checker cannot see an assigned signature)
    __init__.__signature__ = inspect.signature(Client.__init__)  # type: ignore[attr-defined]

    async def put(self, key: BlockKey, value, *, depth: int = 0) -> None:
        await asyncio.to_thread(self._client.put, key, value, depth=depth)

    async def batch_put(self, keys: Sequence[BlockKey], values: Sequence, *, depths=None) -> None:
        await asyncio.to_thread(self._client.batch_put, keys, values, depths=depths)

    async def get(self, key: BlockKey) -> bytes | None:
        return await asyncio.to_thread(self._client.get, key)

    async def batch_get(self, keys: Sequence[BlockKey]) -> list[bytes | None]:
        return await asyncio.to_thread(self._client.batch_get, keys)

    async def get_into(self, key: BlockKey, buffer) -> int | None:
        return await asyncio.to_thread(self._client.get_into, key, buffer)

    async def batch_get_into(self, keys: Sequence[BlockKey], buffers: Sequence) -> list[int | None]:
        return await asyncio.to_thread(self._client.batch_get_into, keys, buffers)

    async def get_ranges_into(self, key: BlockKey, ranges: Sequence, buffers: Sequence) -> list[int | None]:
        return await asyncio.to_thread(self._client.get_ranges_into, key, ranges, buffers)

    async def batch_get_ranges_into(
        self, keys: Sequence[BlockKey], ranges: Sequence, buffers: Sequence
    ) -> list[int | None]:
        return await asyncio.to_thread(self._client.batch_get_ranges_into, keys, ranges, buffers)

    async def exists(self, key: BlockKey) -> bool:
        return await asyncio.to_thread(self._client.exists, key)

    async def batch_exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        return await asyncio.to_thread(self._client.batch_exists, keys)

    async def remove(self, key: BlockKey) -> bool:
        return await asyncio.to_thread(self._client.remove, key)

    async def match_prefix(self, keys: Sequence[BlockKey]) -> PrefixMatch:
        return await asyncio.to_thread(self._client.match_prefix, keys)

    async def store_prefix(self, hasher: BlockHasher, tokens, blocks) -> int:
        return await asyncio.to_thread(self._client.store_prefix, hasher, tokens, blocks)

    async def load_prefix(self, hasher: BlockHasher, tokens, buffers) -> int:
        return await asyncio.to_thread(self._client.load_prefix, hasher, tokens, buffers)

    async def schedule(self, keys: Sequence[BlockKey], input_length: int, output_length: int = 0, request_id: str = ""):
        return await asyncio.to_thread(self._client.schedule, keys, input_length, output_length, request_id)

    async def close(self) -> None:
        await asyncio.to_thread(self._client.close)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
