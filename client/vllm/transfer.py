"""The worker side's data movement: one step's blocks between the pool and the paged KV
tensors, layer by layer, on two threads of its own so that it overlaps the model.

- Loads: ``start`` hands the step's loads to the loader thread, which fetches layer 0's
  blocks of every request, then layer 1's, and so on, setting an event per layer;
  attention of layer ``i`` waits for event ``i`` only, so layer ``i + 1`` moves while layer
  ``i`` computes. A block the pool no longer has (evicted, its node gone) is a load error:
  vLLM recomputes it and everything after it. Every event is set whatever happens, so
  nothing waits forever, and no copy lands after ``finish_loads`` returns.
- Saves: ``save_layer`` queues a layer's new full blocks as soon as its attention ends; the
  saver thread puts them without waiting for the node's answer (the bytes leave the tensor
  before the call returns), and ``finish_saves`` collects the answers before vLLM may reuse
  the blocks. A save that fails costs a later miss, never the request.

Bytes move straight between the pool and each block's slab of the tensor (``kv[block]``,
contiguous): ``get_into`` writes into it, ``put`` reads a view of it.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from kvstore_client.buffers import byte_view
from kvstore_client.errors import KVStoreError, PutFailed
from kvstore_client.vllm.naming import PoolNaming
from kvstore_client.vllm.plans import BlockTransfer

log = logging.getLogger(__name__)


@dataclass
class TransferStats:
    """Blocks (one layer each) moved and failed since start, the bytes loaded and the seconds the
    loader spent on them (one step's loads, first layer to last), for logs and benchmarks."""

    loaded: int = 0
    load_failures: int = 0
    saved: int = 0
    save_failures: int = 0
    loaded_bytes: int = 0
    load_seconds: float = 0.0


class BlockSlabs:
    """The blocks of one layer's paged KV tensor as writable byte views, ``slabs[block_id]``.

    Views are slices of one flat view of the tensor, made once (a few hundred nanoseconds a
    block, where viewing each block of a tensor afresh costs microseconds); a tensor that is
    not one contiguous run is viewed block by block instead."""

    def __init__(self, tensor):
        self._tensor = tensor
        self.nbytes = tensor[0].nbytes
        self._flat = byte_view(tensor, writable=True) if tensor.is_contiguous() else None

    def __getitem__(self, block_id: int):
        if self._flat is None:
            return self._tensor[block_id]
        start = block_id * self.nbytes
        return self._flat[start : start + self.nbytes]


class LayerwiseTransfers:
    """Loads and saves of one engine rank, over ``client`` (a ``kvstore_client.Client``)."""

    def __init__(self, client, naming: PoolNaming, layers: list):
        self._client = client
        self._naming = naming
        self._slabs = [BlockSlabs(tensor) for tensor in layers]  # each layer's paged KV tensor, in order
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvstore-load")
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvstore-save")
        self._layer_loaded: list[threading.Event] | None = None
        self._load_job: Future | None = None
        self._failed_blocks: set[int] = set()
        self._save_jobs: list[Future] = []
        self.stats = TransferStats()

    # -- loads ---------------------------------------------------------------------------------
    def start_loads(self, loads: list[BlockTransfer]) -> None:
        """Begin loading ``loads`` (every layer of each listed block) in the background."""
        self.finish_loads()
        if not loads:
            return
        events = [threading.Event() for _ in self._slabs]
        self._layer_loaded = events
        self._load_job = self._loader.submit(self._load, loads, events)

    def wait_layer(self, layer: int) -> None:
        """Return once layer ``layer`` of this step's loads is in the KV tensor (or failed)."""
        events = self._layer_loaded
        if events is not None:
            events[layer].wait()

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

    def _load(self, loads: list[BlockTransfer], events: list[threading.Event]) -> None:
        todo = [(block_id, h) for t in loads for block_id, h in zip(t.block_ids, t.hashes)]
        start = time.perf_counter()
        try:
            for layer, slabs in enumerate(self._slabs):
                try:
                    todo = self._load_layer(layer, slabs, todo)
                finally:
                    events[layer].set()
        finally:
            for event in events:  # a failure above must not leave attention waiting
                event.set()
            self.stats.load_seconds += time.perf_counter() - start

    def _load_layer(self, layer: int, slabs: "BlockSlabs", todo: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
        """Load one layer of the blocks still good; the blocks still good after it."""
        if not todo:
            return todo
        keys = self._naming.keys(layer, [h for _, h in todo])
        try:
            got = self._client.batch_get_into(keys, [slabs[block_id] for block_id, _ in todo])
        except (KVStoreError, OSError) as exc:
            log.warning("kvstore: loading layer %d of %d blocks failed (%s): vLLM recomputes them",
                        layer, len(todo), exc)
            got = [None] * len(todo)
        kept = []
        slab_bytes = slabs.nbytes
        for (block_id, h), size in zip(todo, got):
            if size != slab_bytes:  # missing, or not this layout's block (a full slab or nothing)
                self._failed_blocks.add(block_id)
            else:
                kept.append((block_id, h))
        self.stats.loaded += len(kept)
        self.stats.loaded_bytes += len(kept) * slab_bytes
        self.stats.load_failures += len(todo) - len(kept)
        return kept

    # -- saves ---------------------------------------------------------------------------------
    def save_layer(self, layer: int, saves: list[BlockTransfer]) -> None:
        """Queue layer ``layer`` of ``saves`` for storing; returns at once."""
        if saves:
            self._save_jobs.append(self._saver.submit(self._save_layer, layer, saves))

    def finish_saves(self) -> None:
        """Wait until every queued save is stored or known failed (vLLM may then free the blocks)."""
        if not self._save_jobs:
            return
        jobs, self._save_jobs = self._save_jobs, []
        for job in jobs:
            job.result()
        self._saver.submit(self._collect_answers).result()

    def _save_layer(self, layer: int, saves: list[BlockTransfer]) -> None:
        slabs = self._slabs[layer]
        for t in saves:
            try:
                self._client.batch_put(self._naming.keys(layer, t.hashes), [slabs[b] for b in t.block_ids],
                                       depths=range(t.first_index, t.first_index + len(t.block_ids)), wait=False)
                self.stats.saved += len(t.block_ids)
            except (KVStoreError, OSError) as exc:
                self.stats.save_failures += len(t.block_ids)
                log.warning("kvstore: saving layer %d of %d blocks failed: %s", layer, len(t.block_ids), exc)

    def _collect_answers(self) -> None:
        """Read the nodes' answers to the puts sent (on the saver thread, which sent them)."""
        try:
            self._client.wait_for_puts()
        except PutFailed as exc:
            self.stats.saved -= len(exc.failures)
            self.stats.save_failures += len(exc.failures)
            log.warning("kvstore: %d block layers were not stored: %s", len(exc.failures), exc.failures[0][2])
        except (KVStoreError, OSError) as exc:
            log.warning("kvstore: waiting for the pool's answers failed: %s", exc)

    def close(self) -> None:
        try:
            self.finish_loads()
            self.finish_saves()
        finally:
            self._loader.shutdown(wait=True)
            self._saver.shutdown(wait=True)
