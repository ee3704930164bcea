"""Where the vLLM connector keeps a block in the pool: one key per block per rank (MLA: per
block, for every rank), its value every layer's slab of that block, a slice per layer.

A key is ``(namespace, digest)``:

- the digest is vLLM's own prefix-cache hash of the block (``request.block_hashes``), which
  already chains the whole prefix and folds in the LoRA adapter and the cache salt;
- the namespace names everything else that makes two engines' bytes for the same tokens
  differ, so that they never share a key::

      <prefix>/<model tag>-<fingerprint>

  ``prefix`` is the user's namespace (``vllm`` by default; a tenant's name once the pool
  checks tokens); the fingerprint is 16 hex digits of XXH3-64 over the value format, the
  model, its revision, the KV dtype, block size, heads per rank, head size, layer count,
  tensor-parallel size and rank, the device kind and the hash algorithm, and the block's
  byte order where it is not the CPU backend's (``kvstore_client.vllm.layouts``: layouts
  that store blocks in another order never share keys). An MLA model's latent KV is the
  same on every rank, so its fingerprint leaves the parallelism out: one value serves every
  rank, of any tensor-parallel size. The model tag is only there for people reading
  ``kvstore keys``.

One value is a sliced value (``kvstore_client.slices``): slice ``i`` is layer ``i``'s slab
of the block in the paged KV tensor, so layer ``i`` is written as soon as its attention ends
and read while layer ``i - 1`` computes; the value is published, and so found by a lookup,
only once every layer is in. ``VALUE_FORMAT`` is in every fingerprint: values of another
format simply miss.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import xxhash

from kvstore_client.keys import BlockKey, check_namespace

VALUE_FORMAT = "sliced-layers-1"  # what one value holds: see the module docstring


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
    mla: bool = False  # one latent vector per token, the same on every tensor-parallel rank

    def fingerprint(self, tp_rank: int) -> str:
        parallel: tuple[object, ...] = ("mla",) if self.mla else (self.tp_size, tp_rank)
        fields: tuple[object, ...] = (
            VALUE_FORMAT,
            self.model,
            self.revision,
            self.kv_dtype,
            self.block_size,
            self.num_kv_heads,
            self.head_size,
            self.num_layers,
            *parallel,
            self.device,
            self.hash_algo,
        )
        if self.block_format:  # only where it is not the CPU backend's order
            fields += (self.block_format,)
        return xxhash.xxh3_64_hexdigest("\x1f".join(map(str, fields)).encode())


def model_tag(model: str) -> str:
    """A short readable name for a model id or path: its last path part, tame characters only."""
    last = model.rstrip("/").rsplit("/", 1)[-1] or "model"
    return re.sub(r"[^A-Za-z0-9._-]", "_", last)[:32]


class PoolNaming:
    """The namespace and keys of one engine rank's blocks."""

    def __init__(self, prefix: str, layout: KVLayout, tp_rank: int = 0):
        self.namespace = check_namespace(f"{prefix}/{model_tag(layout.model)}-{layout.fingerprint(tp_rank)}")
        self.layers = layout.num_layers

    def keys(self, hashes: list[bytes]) -> list[BlockKey]:
        namespace = self.namespace
        return [(namespace, h) for h in hashes]
