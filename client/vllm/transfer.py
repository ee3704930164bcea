"""The worker side's data movement: one step's blocks between the pool and the paged KV
tensors, layer by layer, on two threads of its own so that it overlaps the model.

One value in the pool holds one block of every layer, a slice per layer
(``kvstore_client.vllm.naming``):

- Loads: ``start`` hands the step's loads to the loader thread, which holds the step's
  values (``Client.read_objects``: on this host, leased once), then copies slice 0 of every
  one into layer 0's slabs, then slice 1, and so on, setting an event per layer; attention
  of layer ``i`` waits for event ``i`` only, so layer ``i + 1`` moves while layer ``i``
  computes. A block the pool no longer has (evicted, its node gone, damaged) is a load
  error: vLLM recomputes it and everything after it. Every event is set whatever happens,
  so nothing waits forever, and no copy lands after ``finish_loads`` returns.
- Saves: the step's first ``save_layer`` opens a value for each new full block
  (``Client.open_objects``: arena space on this host); each layer's slabs are written into
  them as soon as its attention ends, on the saver thread; ``finish_saves`` completes them
  (published only then, with every layer in) before vLLM may reuse the blocks. A save that
  fails costs a later miss, never the request.

Bytes move straight between each block's slab of the tensor and its slice when the layout
keeps a block in one run (``LayerSlabs``); other layouts gather and scatter through one
buffer per block.

KV caches in GPU memory: the loader and the saver each run their copies on a CUDA stream of
their own, so they overlap the engine's kernels. ``start`` records an event on the engine's
current stream that the loads wait for (kernels of earlier steps may still use the blocks);
each loaded layer records an event on the load stream, and ``wait_layer`` makes the
engine's current stream wait for it (the engine thread waits only until the loader has
fetched that layer, never for the device); ``save_layer`` records an event on the engine's
stream after the layer's attention, and the saver's copies wait for it, so they read the
KV that attention wrote.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from kvstore_client.buffers import buffer_view
from kvstore_client.errors import KVStoreError, LayoutMismatch, PutFailed
from kvstore_client.objects import ObjectWriter
from kvstore_client.vllm.layouts import BlockFormat, LayerLayout
from kvstore_client.vllm.naming import PoolNaming
from kvstore_client.vllm.plans import BlockTransfer

log = logging.getLogger(__name__)


@dataclass
class TransferStats:
    """Since start: block layers loaded (``loaded``, ``load_failures``: a block per layer),
    blocks saved (``saved``, ``save_failures``: a value of every layer each), the bytes loaded
    and the seconds the loader spent on them (one step's loads, first layer to last), for
    logs and benchmarks."""

    loaded: int = 0
    load_failures: int = 0
    saved: int = 0
    save_failures: int = 0
    loaded_bytes: int = 0
    load_seconds: float = 0.0


class LayerSlabs:
    """The blocks of one layer's paged KV tensor, as buffers the SDK moves.

    ``layout`` (``kvstore_client.vllm.layouts``) says where each block's bytes lie: a block
    that is one run of bytes is a slice of one flat byte view of everything the tensor
    reaches, made once (a few hundred nanoseconds a block, where viewing each block afresh
    costs microseconds), and moves with no copy; a block in several runs (LHBNC, BHLNC, K and
    V apart) is gathered into one buffer to save and scattered from one to load, on the
    tensor's device. A CUDA tensor's views are DeviceViews (``kvstore_client.cuda``)."""

    def __init__(self, tensor, layout: LayerLayout):
        import torch

        self.layout = layout
        self.nbytes = layout.slab_bytes
        self.device = tensor.device
        self._flat = torch.as_strided(tensor.detach(), (layout.extent // tensor.element_size(),), (1,)).view(
            torch.uint8
        )
        self._view = buffer_view(self._flat, writable=True) if layout.contiguous_blocks else None

    def __getitem__(self, block_id: int):
        """Block ``block_id``'s bytes, for a layout whose blocks are one run each."""
        if self._view is None:
            raise TypeError("this layout's blocks are not one run each: copy them run by run")
        start = block_id * self.layout.block_stride + self.layout.run_offsets[0]
        return self._view[start : start + self.nbytes]

    def views(self, block_ids: list[int]) -> list:
        """``self[b]`` for each of ``block_ids`` (the loader's per-layer call: one loop)."""
        view, stride, first, n = self._view, self.layout.block_stride, self.layout.run_offsets[0], self.nbytes
        if view is None:
            raise TypeError("this layout's blocks are not one run each: copy them run by run")
        return [view[b * stride + first : b * stride + first + n] for b in block_ids]

    def gather(self, block_id: int):
        """A new contiguous uint8 tensor (on the tensor's device) of the block's bytes, in order."""
        import torch

        return torch.cat([self._flat[start : start + n] for start, n in self.layout.runs(block_id)])

    def staging(self):
        """A buffer for one block to be loaded into, then ``scatter``ed."""
        import torch

        return torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)

    def scatter(self, block_id: int, staged) -> None:
        """Copy a block's bytes from ``staged`` (``staging()``) to where the layout keeps them."""
        at = 0
        for start, n in self.layout.runs(block_id):
            self._flat[start : start + n].copy_(staged[at : at + n], non_blocking=True)
            at += n

    def to_save(self, block_ids: list[int]) -> list:
        return self.views(block_ids) if self._view is not None else [self.gather(b) for b in block_ids]


def whole_block_layout(tensor) -> LayerLayout:
    """The layout of a tensor whose dimension 0 is the block, each block contiguous (the
    caller knows no more about it): what vLLM's CPU backend hands over."""
    if not tensor[0].is_contiguous():
        raise LayoutMismatch(
            f"KV cache layout not supported: shape {tuple(tensor.shape)}, strides {tensor.stride()}; "
            "without a known layout the connector needs one contiguous slab per block"
        )
    itemsize = tensor.element_size()
    slab = tensor[0].numel() * itemsize
    extent = (sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride())) + 1) * itemsize
    return LayerLayout(
        "blocks",
        BlockFormat((("slab", slab),), str(tensor.dtype)),
        tensor.shape[0],
        tensor.stride(0) * itemsize,
        (0,),
        slab,
        extent,
    )


class LayerwiseTransfers:
    """Loads and saves of one engine rank, over ``client`` (a ``kvstore_client.Client``).

    ``layers``: each layer's paged KV tensor, in order; ``layouts``: their ``LayerLayout``s
    (default: dimension 0 is the block, each block contiguous); ``block_format``: the format
    the keys of ``naming`` hold, which every layer must store (LayoutMismatch otherwise);
    ``save``: whether this rank stores what it computes (an MLA model's ranks hold the same
    KV: one of them stores it)."""

    def __init__(
        self,
        client,
        naming: PoolNaming,
        layers: list,
        layouts: list[LayerLayout] | None = None,
        block_format: BlockFormat | None = None,
        save: bool = True,
    ):
        self._client = client
        self._naming = naming
        layouts = layouts if layouts is not None else [whole_block_layout(t) for t in layers]
        for n, layout in enumerate(layouts):
            if block_format is not None:
                layout.format.check_readable_as(block_format)
            if n and layout.format != layouts[0].format:
                raise LayoutMismatch(f"layer {n} stores {layout.format.name()}, layer 0 {layouts[0].format.name()}")
        self._slabs = [LayerSlabs(tensor, layout) for tensor, layout in zip(layers, layouts, strict=True)]
        self._device = layers[0].device if layers and layers[0].device.type == "cuda" else None
        start_load, start_save = self._streams()
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvstore-load", initializer=start_load)
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvstore-save", initializer=start_save)

        self._layer_loaded: list[threading.Event] | None = None
        self._layer_events: list = []  # CUDA: an event per loaded layer, on the load stream
        self._load_job: Future | None = None
        self._failed_blocks: set[int] = set()
        self._load_order: list[tuple[int, bytes]] = []  # the step's blocks, in the reader's order
        self._save_jobs: list[Future] = []
        self._save = save
        self._writer: ObjectWriter | None = None  # the step's open values, on the saver thread
        self._step_blocks = 0  # how many blocks the step saves
        self._slice_lengths = [slabs.nbytes for slabs in self._slabs]
        self.stats = TransferStats()

    def _streams(self):
        """Thread initializers that make a stream of its own current on the loader and on the
        saver (CUDA; nothing for host tensors)."""
        if self._device is None:
            return None, None
        from kvstore_client.cuda import new_stream

        device = self._device

        def use_own_stream() -> None:
            import torch

            torch.cuda.set_device(device)
            torch.cuda.set_stream(new_stream(device))

        return use_own_stream, use_own_stream

    def _event_now(self):
        """An event recorded now on the calling thread's current stream (CUDA: the engine's
        stream on the engine thread, the load stream on the loader), or None for host tensors."""
        if self._device is None:
            return None
        from kvstore_client.cuda import record_event

        return record_event(self._device)

    def _after(self, event) -> None:
        """Make this thread's current stream wait for ``event`` (CUDA; None: nothing to wait for)."""
        if event is not None:
            import torch

            torch.cuda.current_stream(self._device).wait_event(event)

    # -- loads ---------------------------------------------------------------------------------
    def start_loads(self, loads: list[BlockTransfer]) -> None:
        """Begin loading ``loads`` (every layer of each listed block) in the background."""
        self.finish_loads()
        if not loads:
            return
        events = [threading.Event() for _ in self._slabs]
        self._layer_loaded = events
        self._layer_events = [None] * len(self._slabs)
        self._load_job = self._loader.submit(self._load, loads, events, self._event_now())

    def wait_layer(self, layer: int) -> None:
        """Return once layer ``layer`` of this step's loads is in the KV tensor (or failed); on a
        GPU, once its copies are queued before the engine's next kernels (stream order)."""
        events = self._layer_loaded
        if events is not None:
            events[layer].wait()
            self._after(self._layer_events[layer])

    def finish_loads(self) -> None:
        """Wait until the current step's loads are over: after this, no copy touches the tensors."""
        job, self._load_job, self._layer_loaded = self._load_job, None, None
        if job is not None:
            job.result()

    def take_load_failures(self) -> set[int]:
        """Block ids whose load failed since the last call (vLLM recomputes them)."""
        self.finish_loads()
        failed, self._failed_blocks = self._failed_blocks, set()
        if failed:
            log.warning("kvstore: %d blocks could not be loaded from the pool: vLLM recomputes them", len(failed))
        return failed

    def _load(self, loads: list[BlockTransfer], events: list[threading.Event], ready) -> None:
        todo = [(block_id, h) for t in loads for block_id, h in zip(t.block_ids, t.hashes)]
        self._load_order = todo
        start = time.perf_counter()
        reader = None
        try:
            try:
                reader = self._client.read_objects(self._naming.keys([h for _, h in todo]), slices=len(self._slabs))
            except (KVStoreError, OSError) as exc:
                log.warning("kvstore: finding %d blocks in the pool failed (%s): vLLM recomputes them", len(todo), exc)
                self._failed_blocks.update(block_id for block_id, _ in todo)
                todo = []
            self._after(ready)  # kernels the engine queued before this step may still use the blocks
            for layer, slabs in enumerate(self._slabs):
                try:
                    todo = self._load_layer(layer, slabs, reader, todo)
                finally:
                    self._layer_events[layer] = self._event_now()  # on the load stream
                    events[layer].set()
        finally:
            for event in events:  # a failure above must not leave attention waiting
                event.set()
            last = self._layer_events[-1] if self._layer_events else None
            if last is not None:
                last.synchronize()  # scatters still queued end before finish_loads returns
            if reader is not None:
                reader.close()
            self.stats.load_seconds += time.perf_counter() - start

    def _load_layer(self, layer: int, slabs: LayerSlabs, reader, todo: list[tuple[int, bytes]]):
        """Load one layer (slice ``layer`` of each value, in the reader's order) of the blocks
        still good; the blocks still good after it."""
        if not todo:
            return todo
        whole = slabs.layout.contiguous_blocks
        order = self._load_order
        if not whole:
            buffers = [slabs.staging() for _ in order]
        elif len(todo) == len(order):  # nothing failed so far: every block's slab
            buffers = slabs.views([block_id for block_id, _ in order])
        else:
            good = dict(todo)
            buffers = [slabs[block_id] if block_id in good else None for block_id, _ in order]
        try:
            got = reader.read_into(layer, buffers, exact=True)
        except (KVStoreError, OSError) as exc:
            log.warning(
                "kvstore: loading layer %d of %d blocks failed (%s): vLLM recomputes them", layer, len(todo), exc
            )
            got = [None] * len(buffers)
        slab_bytes = slabs.nbytes
        if whole and len(todo) == len(order) and got.count(slab_bytes) == len(got):
            kept = todo  # the common case: every block's slice is in
        else:
            kept = []
            for (block_id, h), size, buffer in zip(order, got, buffers):
                if buffer is None:
                    continue
                if size != slab_bytes:  # missing, damaged, or not this layout's block
                    self._failed_blocks.add(block_id)
                else:
                    if not whole:
                        slabs.scatter(block_id, buffer)
                    kept.append((block_id, h))
        self.stats.loaded += len(kept)
        self.stats.loaded_bytes += len(kept) * slab_bytes
        self.stats.load_failures += len(todo) - len(kept)
        return kept

    # -- saves ---------------------------------------------------------------------------------
    def save_layer(self, layer: int, saves: list[BlockTransfer]) -> None:
        """Queue layer ``layer`` of ``saves`` for storing; returns at once (on a GPU, the copies
        wait for what the engine queued so far: the layer's attention)."""
        if saves and self._save:
            self._save_jobs.append(self._saver.submit(self._save_layer, layer, saves, self._event_now()))

    def finish_saves(self) -> None:
        """Wait until every queued save is written, then publish the step's values (vLLM may
        then free the blocks). A value missing a layer is given up: a later miss."""
        if not self._save_jobs:
            return
        jobs, self._save_jobs = self._save_jobs, []
        for job in jobs:
            job.result()
        self._saver.submit(self._complete).result()

    def _save_layer(self, layer: int, saves: list[BlockTransfer], ready=None) -> None:
        slabs = self._slabs[layer]
        self._after(ready)
        block_ids = [block_id for t in saves for block_id in t.block_ids]
        self._step_blocks = len(block_ids)
        try:
            writer = self._writer
            if writer is None:  # the step's first layer: open a value for each block
                keys = self._naming.keys([h for t in saves for h in t.hashes])
                depths = [t.first_index + n for t in saves for n in range(len(t.block_ids))]
                writer = self._writer = self._client.open_objects(keys, self._slice_lengths, depths=depths)
            writer.write(layer, slabs.to_save(block_ids))
        except (KVStoreError, OSError) as exc:
            log.warning("kvstore: saving layer %d of %d blocks failed: %s", layer, len(block_ids), exc)

    def _complete(self) -> None:
        """Publish the step's values (on the saver thread, which opened them) without waiting for
        the nodes' answers: the bytes are with the nodes, so vLLM may free the blocks; the answers
        are read with the next step's (or ``collect_answers``), and counted then."""
        writer, self._writer = self._writer, None
        blocks, self._step_blocks = self._step_blocks, 0
        if writer is None:  # not even opened: the pool could not be reached
            self.stats.save_failures += blocks
            return
        self._collect_answers()  # the previous steps': long arrived
        total = len(writer.keys)
        try:
            writer.complete(wait=False)
            self.stats.saved += total
        except PutFailed as exc:
            self.stats.saved += total - len(exc.failures)
            self.stats.save_failures += len(exc.failures)
            log.warning("kvstore: %d of %d blocks were not stored: %s", len(exc.failures), total, exc.failures[0][2])
        except (KVStoreError, OSError) as exc:
            self.stats.save_failures += total
            log.warning("kvstore: storing %d blocks failed: %s", total, exc)
            writer.abort()

    def _collect_answers(self) -> None:
        """Read the nodes' answers to values published without waiting (on the saver thread)."""
        try:
            self._client.wait_for_puts()
        except PutFailed as exc:
            self.stats.saved -= len(exc.failures)
            self.stats.save_failures += len(exc.failures)
            log.warning("kvstore: %d blocks were not stored: %s", len(exc.failures), exc.failures[0][2])
        except (KVStoreError, OSError) as exc:
            log.warning("kvstore: reading the pool's answers failed: %s", exc)

    def collect_answers(self) -> None:
        """Wait for the answers to every value published so far, and count them (stats)."""
        self._saver.submit(self._collect_answers).result()

    def close(self) -> None:
        try:
            self.finish_loads()
            self.finish_saves()
            self.collect_answers()
        finally:
            self._loader.shutdown(wait=True)
            self._saver.shutdown(wait=True)
