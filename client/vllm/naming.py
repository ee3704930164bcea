"""Where the vLLM connector keeps a block in the pool: one key per block per attention layer.

A key is ``(namespace, digest)``:

- the digest is vLLM's own prefix-cache hash of the block (``request.block_hashes``), which
  already chains the whole prefix and folds in the LoRA adapter and the cache salt;
- the namespace names everything else that makes two engines' bytes for the same tokens
  differ, so that they never share a key::

      <prefix>/<model tag>-<fingerprint>/layer<i>

  ``prefix`` is the user's namespace (``vllm`` by default; a tenant's name once the pool
  checks tokens); the fingerprint is 16 hex digits of XXH3-64 over the model, its revision,
  the KV dtype, block size, heads per rank, head size, layer count, tensor-parallel size and
  rank, the device kind and the hash algorithm, and the block's byte order where it is not
  the CPU backend's (``kvstore_client.vllm.layouts``: layouts that store blocks in another
  order never share keys). The model tag is only there for people reading ``kvstore keys``.

One value is one block of one layer: the layer's slab of that block in the paged KV tensor,
contiguous, so it moves with no copy and layer ``i`` can be saved as soon as its attention
ends and loaded while layer ``i - 1`` computes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import xxhash

from kvstore_client.keys import BlockKey, check_namespace


@dataclass(frozen=True)
class KVLayout:
    """What must match for two engines to read each other's blocks."""

    model: str
    revision: str
    kv_dtype: str
    block_size: int
    num_kv_heads: int  # per tensor-parallel rank
    head_size: int
    num_layers: int
    tp_size: int
    device: str
    hash_algo: str
    block_format: str = ""  # the byte order of a stored block, when not the CPU backend's (layouts.py)

    def fingerprint(self, tp_rank: int) -> str:
        fields: tuple[object, ...] = (
            self.model,
            self.revision,
            self.kv_dtype,
            self.block_size,
            self.num_kv_heads,
            self.head_size,
            self.num_layers,
            self.tp_size,
            tp_rank,
            self.device,
            self.hash_algo,
        )
        if self.block_format:  # only then: the keys of the CPU backend's order stay as they were
            fields += (self.block_format,)
        return xxhash.xxh3_64_hexdigest("\x1f".join(map(str, fields)).encode())


def model_tag(model: str) -> str:
    """A short readable name for a model id or path: its last path part, tame characters only."""
    last = model.rstrip("/").rsplit("/", 1)[-1] or "model"
    return re.sub(r"[^A-Za-z0-9._-]", "_", last)[:32]


class PoolNaming:
    """The namespaces (one per layer) and keys of one engine rank's blocks."""

    def __init__(self, prefix: str, layout: KVLayout, tp_rank: int = 0):
        base = f"{prefix}/{model_tag(layout.model)}-{layout.fingerprint(tp_rank)}"
        self.namespaces = [check_namespace(f"{base}/layer{i}") for i in range(layout.num_layers)]

    def keys(self, layer: int, hashes: list[bytes]) -> list[BlockKey]:
        namespace = self.namespaces[layer]
        return [(namespace, h) for h in hashes]

    @property
    def last_layer(self) -> int:
        """The layer looked up to decide a hit: saved last, so its presence means the block's
        every layer was sent (a layer lost since is a load error, and vLLM recomputes)."""
        return len(self.namespaces) - 1
