"""Making room: watermark eviction, demotion DRAM -> SSD, promotion SSD -> DRAM.

Mechanism only: which block goes is the tier's policy's call. Eviction runs
in a background thread woken when a tier passes its high watermark (it
sleeps otherwise), and works in batches until the tier is under its low
watermark. A pass takes the store lock only to choose victims and to switch
their state; the SSD writes of a demotion batch happen outside it, while the
victims' DRAM extents are leased so their bytes stay put.

``evict_lock`` serialises passes (background and inline); it is taken before
the store lock, never after.

A ``Tiering`` is one of the store's parts: it is built with the store's shared state
(``kvstore.node.block_table.StoreState``: the block table, the tiers, the policies,
the counters, the store lock) and configuration, and works on those only.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from kvstore.node.block_table import DRAM, SSD, StoreState
from kvstore.tiers.dram import Extent

if TYPE_CHECKING:
    from kvstore.node.config import StoreConfig

log = logging.getLogger(__name__)

_RETRY_S = 0.1  # how often a pass that could not bring a tier under its high watermark is retried


class Tiering:
    """Eviction, demotion and promotion for one BlockStore, on its shared ``state``."""

    def __init__(self, state: StoreState, config: "StoreConfig"):
        self._state = state
        self._config = config
        self.evict_lock = threading.Lock()
        self.inline_passes = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._high, self._low = config.high_watermark, config.low_watermark

    # -- background thread ------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="kvstore-evictor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()

    def poke(self) -> None:
        """Wake the evictor when a tier is over its high watermark."""
        if self._thread is not None and self._over_high():
            self._wake.set()

    def _over_high(self) -> bool:
        dram, ssd = self._state.dram, self._state.ssd
        if dram.used_bytes > self._high * dram.capacity_bytes:
            return True
        return ssd is not None and ssd.used_bytes > self._high * ssd.capacity_bytes

    def _loop(self) -> None:
        while not self._stop.is_set():
            # Under the high watermark only a put or a promotion (each pokes) can take a tier over
            # it: sleep until one does. Over it (its blocks pinned or leased), retry now and then.
            self._wake.wait(_RETRY_S if self._over_high() else None)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.run_once()
            except Exception:  # keep evicting later rather than die silently
                log.exception("eviction pass failed")

    # -- passes -----------------------------------------------------------------------
    def run_once(self) -> None:
        """Bring every tier over its high watermark down to its low watermark."""
        with self.evict_lock:
            dram = self._state.dram
            if dram.used_bytes > self._high * dram.capacity_bytes:
                self._evict_dram_to(int(self._low * dram.capacity_bytes))
            ssd = self._state.ssd
            if ssd is not None and ssd.used_bytes > self._high * ssd.capacity_bytes:
                self._evict_ssd(ssd.used_bytes - int(self._low * ssd.capacity_bytes))

    def _evict_dram_to(self, target_used: int) -> None:
        dram, batch = self._state.dram, self._config.eviction_batch
        while dram.used_bytes > target_used:
            if not self._evict_dram(dram.used_bytes - target_used, batch):
                return

    def make_room(self, size: int) -> Extent | None:
        """Inline last resort for a put that found no free extent: evict until
        ``size`` bytes fit, then reserve them. None when nothing more can go."""
        dram = self._state.dram
        with self.evict_lock:
            self.inline_passes += 1
            while True:
                extent = dram.reserve(size)
                if extent is not None:
                    return extent
                footprint = dram.footprint(size)
                shortfall = footprint - (dram.capacity_bytes - dram.used_bytes)
                wanted = shortfall if shortfall > 0 else footprint  # free but fragmented: free more
                if not self._evict_dram(wanted, self._config.eviction_batch):
                    return dram.reserve(size)

    # -- DRAM -> SSD or out ----------------------------------------------------------------
    def _evict_dram(self, wanted: int, max_blocks: int) -> int:
        """Demote (or drop, without SSD) up to ``max_blocks`` DRAM victims
        totalling at least ``wanted`` bytes; returns how many victims it took,
        0 only when nothing is evictable. (Not how many moved: a batch whose
        victims were all replaced, removed or pinned meanwhile moves none, yet
        other candidates may remain, so callers must keep going.)"""
        state = self._state
        victims = self._choose_dram_victims(wanted, max_blocks)
        if not victims:
            return 0
        kept = [meta.ssd_copy for _, meta, _ in victims]  # already on SSD: nothing to write
        written = [False] * len(victims)
        fresh = [j for j, on_ssd in enumerate(kept) if not on_ssd]
        if state.ssd is not None and fresh:
            for j, ok in zip(fresh, self._write_to_ssd([victims[j] for j in fresh])):
                written[j] = ok
        with state.lock:
            for (key, meta, extent), was_kept, wrote in zip(victims, kept, written):
                current = state.blocks.get(key) is meta and meta.tier == DRAM and not meta.pins
                if current and state.dram.current(key) is extent:
                    state.dram.discard(key)
                    if wrote or (was_kept and meta.ssd_copy):  # a kept copy may have been dropped meanwhile
                        meta.tier, meta.ssd_copy = SSD, False
                        state.policies[SSD].discard(key)
                        state.policies[SSD].add(key, depth=meta.depth, hits=meta.hits)
                        state.counters[DRAM].demotions += 1
                        state.emit("moved", key, SSD)
                    else:
                        state.unlist(key, meta, DRAM)
                        state.counters[DRAM].evictions += 1
                elif wrote:  # replaced, removed or pinned meanwhile: the copy is stale
                    state.ssd.discard(key)
                state.dram.release(extent)
        return len(victims)

    def _choose_dram_victims(self, wanted: int, max_blocks: int) -> list:
        """Under the store lock: pop victims, skipping blocks being read, and
        lease each victim's extent so its bytes survive until it is moved."""
        state = self._state
        policy, dram, table = state.policies[DRAM], state.dram, state.blocks
        victims, skipped, total = [], [], 0
        with state.lock:
            while total < wanted and len(victims) < max_blocks:
                key = policy.pop_victim()
                if key is None:
                    break
                meta = table.get(key)
                if meta is None or meta.tier != DRAM or meta.pins:
                    continue
                if dram.is_leased(key):
                    skipped.append((key, meta))
                    continue
                victims.append((key, meta, dram.acquire(key)))
                total += dram.footprint(meta.size)
            for key, meta in skipped:
                policy.add(key, depth=meta.depth, hits=meta.hits)
        return victims

    def _write_to_ssd(self, victims: list) -> list[bool]:
        """Write the victims to SSD after making room there; whether each was written. When the
        disk fills under the batch, the tier's capacity shrinks to what it holds: make room in
        that and write the rest once more."""
        ssd, dram = self._state.ssd, self._state.dram
        items = [(key, dram.view(extent), extent.checksum, meta.depth) for key, meta, extent in victims]
        written = [False] * len(items)
        for _ in range(2):
            todo = [i for i, done in enumerate(written) if not done]
            capacity = ssd.capacity_bytes
            incoming = sum(items[i][1].nbytes for i in todo)
            if ssd.used_bytes + incoming > self._high * capacity:
                self._evict_ssd(ssd.used_bytes + incoming - int(self._low * capacity))
            for i, done in zip(todo, ssd.put_many([items[i] for i in todo])):
                written[i] = done
            if all(written) or ssd.capacity_bytes >= capacity:
                break
        return written

    # -- SSD out ----------------------------------------------------------------------------
    def _evict_ssd(self, wanted: int) -> None:
        """Drop SSD victims totalling at least ``wanted`` bytes."""
        state = self._state
        policy, table, victims, freed = state.policies[SSD], state.blocks, [], 0  # table: read only
        with state.lock:
            while freed < wanted:
                key = policy.pop_victim()
                if key is None:
                    break
                meta = table.get(key)
                if meta is not None and meta.tier == DRAM and meta.ssd_copy:  # the block stays in DRAM
                    meta.ssd_copy = False
                    victims.append(key)
                    freed += meta.size
                    continue
                if meta is None or meta.tier != SSD or meta.pins:
                    continue
                state.unlist(key, meta, SSD)
                victims.append(key)
                freed += meta.size
                state.counters[SSD].evictions += 1
        if victims:
            state.ssd.discard_many(victims)

    # -- SSD -> DRAM ----------------------------------------------------------------------------
    def promote(self, key, meta, data: memoryview, checksum: int) -> None:
        """Copy a block just read from SSD, and verified there against ``checksum``, into DRAM
        and make DRAM its home; with ``keep_ssd_copy`` (and unless pinned) its SSD record
        stays, as an SSD eviction candidate. Best effort: never evicts inline; skipped when
        DRAM has no free extent."""
        state, dram = self._state, self._state.dram
        extent = dram.reserve(len(data))
        if extent is None:
            self.poke()
            return
        dram.writable(extent)[:] = data
        with state.lock:
            if state.blocks.get(key) is meta and meta.tier == SSD and not state.closed:
                if self._config.keep_ssd_copy and not meta.pins:
                    meta.ssd_copy = True
                else:
                    state.ssd.discard(key)
                    state.policies[SSD].discard(key)
                dram.commit(key, extent, checksum)
                extent = None
                meta.tier = DRAM
                if not meta.pins:
                    state.policies[DRAM].add(key, depth=meta.depth, hits=meta.hits)
                state.counters[SSD].promotions += 1
                state.emit("moved", key, DRAM)
        if extent is not None:
            dram.abort(extent)
        self.poke()
