"""Where each block's bytes lie in a layer's paged KV tensor, for the KV cache layouts vLLM
uses, and which layouts can read each other's blocks. Pure logic on shapes and strides
(no torch, no vLLM), so every layout is tested on CPU.

Families, named by the logical axes of one layer's cache tensor:

- ``vllm``: the per-layer view vLLM 0.32 hands to connectors on every backend, logical
  ``[B, H, N, C]`` (blocks, KV heads, tokens, C = K then V, ``head_size`` each), its strides
  set by the ``KVCacheLayout`` (``vllm.v1.kv_cache_layout``): LBHNC (the CPU backend; HND),
  LBNHC (vLLM's default, what FlashAttention gets; NHD), LHBNC, BLHNC and BLNHC (FlashInfer
  on Blackwell), BHLNC. ``B`` outer of ``L`` interleaves the layers block by block, so a
  layer's tensor is not contiguous though each of its blocks may be;
- ``flash_attn``: earlier vLLM's FlashAttention cache, ``(2, B, N, H, D)``: K and V of a
  block lie in two runs;
- ``flashinfer``: earlier vLLM's FlashInfer cache, ``(B, 2, N, H, D)``, with the NHD stride
  order (as shaped) or HND (``get_kv_cache_stride_order``: H outer of N in memory);
- ``mla``: an MLA model's cache (DeepSeek-V2/V3, Kimi K2: vLLM's MLA backends),
  ``(B, N, D)``, one latent vector of ``D`` (the KV LoRA rank plus the rope dimensions) per
  token, the same on every tensor-parallel rank; ``mla_cpu``, vLLM's CPU MLA backend's,
  ``(B, 1, N, D)``: the same bytes.

What the pool holds of one layer of one block (a slice of the block's value,
``kvstore_client.vllm.naming``) is the block's bytes in memory order (its
runs, lowest address first, concatenated). Its ``BlockFormat`` is the block's axes in that
order with their sizes (C counted as KV x D, axes of size 1 left out, since they do not
change the order), plus the dtype: two layouts with the same format hold the same bytes for
the same KV, so one reads the other's blocks (LBHNC, LHBNC, BLHNC and BHLNC all store
``H, N, KV, D``; LBNHC and BLNHC ``N, H, KV, D``; with one KV head all of these agree). Any
other pair is refused (``LayoutMismatch``): no conversion is made.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

from kvstore_client.errors import LayoutMismatch

FAMILIES = {
    "vllm": ("B", "H", "N", "C"),
    "flash_attn": ("KV", "B", "N", "H", "D"),
    "flashinfer": ("B", "KV", "N", "H", "D"),
    "mla": ("B", "N", "D"),
    "mla_cpu": ("B", "H", "N", "D"),
}
CANONICAL_ORDER = ("H", "N", "KV", "D")  # the CPU backend's (LBHNC) order: its keys carry no format
# KVCacheLayout names -> physical order of the logical axes (L, B, H, N, C), as vLLM defines them
KV_CACHE_LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
LEGACY_NAMES = {"HND": "LBHNC", "NHD": "LBNHC"}  # FlashInfer's names, as vLLM's aliases


@dataclass(frozen=True)
class BlockFormat:
    """The byte order of one stored block: ``axes`` ((name, size), outermost first) and dtype."""

    axes: tuple[tuple[str, int], ...]
    dtype: str

    @property
    def order(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.axes)

    def name(self) -> str:
        """e.g. ``N16.H8.KV2.D128``: for the pool's key fingerprint."""
        return ".".join(f"{axis}{size}" for axis, size in self.axes)

    def is_canonical(self) -> bool:
        """The CPU backend's order (``H, N, KV, D`` without its size-1 axes)."""
        return self.order == tuple(a for a in CANONICAL_ORDER if a in self.order)

    def check_readable_as(self, other: "BlockFormat") -> None:
        """LayoutMismatch unless a block stored in this format reads correctly as ``other``."""
        if self != other:
            raise LayoutMismatch(
                f"blocks stored as {self.name()} ({self.dtype}) cannot be read into a layout that "
                f"holds {other.name()} ({other.dtype}): the bytes are in another order"
            )


@dataclass(frozen=True)
class LayerLayout:
    """One layer's cache tensor: where block ``b``'s bytes are (``runs(b)``: (byte offset from
    the first byte the tensor reaches, length), in memory order) and their format."""

    family: str
    format: BlockFormat
    num_blocks: int
    block_stride: int  # bytes from block b to block b + 1
    run_offsets: tuple[int, ...]  # of block 0's runs
    run_bytes: int  # every run's length
    extent: int  # bytes from the tensor's first byte to one past its last

    @property
    def slab_bytes(self) -> int:
        return self.run_bytes * len(self.run_offsets)

    @property
    def contiguous_blocks(self) -> bool:
        """Each block is one run: it moves with no gather or scatter."""
        return len(self.run_offsets) == 1

    def runs(self, block: int) -> list[tuple[int, int]]:
        base = block * self.block_stride
        return [(base + offset, self.run_bytes) for offset in self.run_offsets]


def describe(family: str, shape, strides, itemsize: int, dtype: str, head_size: int) -> LayerLayout:
    """The layout of a layer tensor of ``family`` with this ``shape`` and ``strides`` (in
    elements); LayoutMismatch for a family not known or strides it cannot move (the innermost
    axis not dense, or blocks that overlap)."""
    axes = FAMILIES.get(family)
    if axes is None:
        raise LayoutMismatch(f"unknown KV cache family {family!r}; known: {sorted(FAMILIES)}")
    if len(shape) != len(axes) or len(strides) != len(axes):
        raise LayoutMismatch(f"a {family} KV cache has {len(axes)} axes {axes}, not shape {tuple(shape)}")
    block_axis = axes.index("B")
    inner = sorted(
        (i for i in range(len(axes)) if i != block_axis and shape[i] > 1), key=lambda i: strides[i], reverse=True
    )  # the block's axes in memory order, outer first
    runs_from = len(inner)  # axes inner[runs_from:] merge into one dense run
    run = 1
    while runs_from and strides[inner[runs_from - 1]] == run:
        runs_from -= 1
        run *= shape[inner[runs_from]]
    if inner and runs_from == len(inner):
        raise LayoutMismatch(f"{family} KV cache with strides {tuple(strides)}: its innermost axis is not dense")
    outer = inner[:runs_from]
    span = run  # elements one block spans, checked nested: each axis steps past everything inside it
    for i in reversed(outer):
        if strides[i] < span:
            raise LayoutMismatch(
                f"{family} KV cache with shape {tuple(shape)} and strides {tuple(strides)}: a block's axes overlap"
            )
        span = strides[i] * (shape[i] - 1) + span
    offsets = tuple(
        sum(index * strides[i] for index, i in zip(where, outer))
        for where in product(*(range(shape[i]) for i in outer))
    )
    extent = sum((n - 1) * s for n, s in zip(shape, strides)) + 1
    return LayerLayout(
        family,
        _format([(axes[i], shape[i]) for i in inner], head_size, dtype),
        shape[block_axis],
        strides[block_axis] * itemsize,
        tuple(o * itemsize for o in offsets),
        run * itemsize,
        extent * itemsize,
    )


def _format(axes: list[tuple[str, int]], head_size: int, dtype: str) -> BlockFormat:
    """Axes in memory order with C, when it is K then V of ``head_size`` each, as (KV, D)."""
    named = []
    for axis, size in axes:
        if axis == "C" and size == 2 * head_size:
            named += [("KV", 2), ("D", head_size)] if head_size > 1 else [("KV", 2)]
        else:
            named.append((axis, size))
    return BlockFormat(tuple(named), dtype)


def layout_format(name: str, num_kv_heads: int, block_size: int, head_size: int, dtype: str) -> BlockFormat:
    """The format the ``vllm`` family stores under a KVCacheLayout ``name`` (or HND / NHD), from
    the configuration alone: what the scheduler, which has no tensors, names the keys by."""
    order = KV_CACHE_LAYOUTS.get(LEGACY_NAMES.get(name, name))
    if order is None:
        raise LayoutMismatch(f"unknown KV cache layout {name!r}; known: {sorted(KV_CACHE_LAYOUTS)}")
    sizes = {2: ("H", num_kv_heads), 3: ("N", block_size), 4: ("C", 2 * head_size)}
    return _format([sizes[d] for d in order if d in sizes and sizes[d][1] > 1], head_size, dtype)


def mla_format(block_size: int, head_size: int, dtype: str) -> BlockFormat:
    """The format of an MLA cache's block (``mla`` family): tokens, then the latent vector."""
    return BlockFormat(tuple((axis, n) for axis, n in (("N", block_size), ("D", head_size)) if n > 1), dtype)


def identify(shape, num_blocks: int, num_kv_heads: int, block_size: int, head_size: int) -> str:
    """Which family a layer tensor of ``shape`` is, given the engine's KV spec; LayoutMismatch
    when it is none of them (a ``vllm`` tensor whose blocks vLLM split into smaller kernel
    blocks, ``num_blocks`` times more of them, among those: not supported yet)."""
    shape = tuple(shape)
    if shape == (num_blocks, num_kv_heads, block_size, 2 * head_size):
        return "vllm"
    if shape == (2, num_blocks, block_size, num_kv_heads, head_size):
        return "flash_attn"
    if shape == (num_blocks, 2, block_size, num_kv_heads, head_size):
        return "flashinfer"
    if num_kv_heads == 1 and shape == (num_blocks, block_size, head_size):
        return "mla"
    if num_kv_heads == 1 and shape == (num_blocks, 1, block_size, head_size):
        return "mla_cpu"
    raise LayoutMismatch(
        f"KV cache of shape {shape} is not a layout the connector knows for {num_blocks} blocks of "
        f"{block_size} tokens, {num_kv_heads} KV heads of size {head_size}"
    )


def permuted_strides(shape, order) -> tuple[int, ...]:
    """Element strides of a dense tensor of logical ``shape`` laid out in memory in ``order``
    (logical axes, outermost first): how vLLM derives a layout's strides."""
    strides = [0] * len(shape)
    step = 1
    for axis in reversed(order):
        strides[axis] = step
        step *= shape[axis]
    return tuple(strides)


__all__ = [
    "BlockFormat",
    "FAMILIES",
    "KV_CACHE_LAYOUTS",
    "LayerLayout",
    "describe",
    "identify",
    "layout_format",
    "mla_format",
    "permuted_strides",
]
