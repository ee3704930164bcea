"""vLLM's KVEventBatch msgpack encoding, written with msgspec (as vLLM does).

The layout matches vllm.distributed.kv_events byte for byte: a batch is an
array ``[ts, events, data_parallel_rank]`` (array_like); each event a map
tagged ``{"type": "<class name>", ...}`` with BlockStored's fields in vLLM's
order (block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
lora_name), and fields at their default left out (omit_defaults), so vLLM's
optional trailing fields never appear. tests/test_kv_events.py checks the bytes
against vLLM's own encoder and decodes them with vLLM's decoder.

Imports msgspec: load this module only when KV events are on.
"""

from __future__ import annotations

from typing import Sequence

import msgspec

from kvstore.master.kv_events import CLEARED, REMOVED, STORED, Event, hash_value


class _EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class _KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_KVCacheEvent):
    block_hashes: list
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(_KVCacheEvent):
    block_hashes: list
    medium: str | None


class AllBlocksCleared(_KVCacheEvent):
    pass


assert (BlockStored.__name__, BlockRemoved.__name__, AllBlocksCleared.__name__) == (STORED, REMOVED, CLEARED)


class Encoder:
    """Encodes (kind, medium, digests) events as one KVEventBatch payload."""

    def __init__(self, hashes: str = "bytes", data_parallel_rank: int = 0):
        self._hashes = hashes
        self._rank = data_parallel_rank
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, ts: float, events: Sequence[Event]) -> bytes:
        return self._encoder.encode(_EventBatch(ts, [self._event(e) for e in events], self._rank))

    def _event(self, event: Event):
        kind, medium, digests = event
        if kind == CLEARED:
            return AllBlocksCleared()
        hashes = digests if self._hashes == "bytes" else [hash_value(d, self._hashes) for d in digests]
        if kind == REMOVED:
            return BlockRemoved(block_hashes=hashes, medium=medium)
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=None,
            token_ids=[],
            block_size=0,
            lora_id=None,
            medium=medium,
            lora_name=None,
        )
